"""Network stack: the VPC, its one cluster subnet, VPC endpoints, flow logs, security groups.

Every node sits in one private subnet pinned to an Availability Zone *ID* (EFA traffic does not
cross subnets, and zone IDs, unlike names, mean the same zone in every account). The nodes reach
AWS through VPC endpoints, so the cluster also works with no NAT gateway
(`internet_egress=endpoints`).
"""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from stacks.config import ClusterConfig
from stacks.log_groups import allow_cloudwatch_logs, retention
from stacks.nag import acknowledge

VPC_CIDR = "10.0.0.0/16"
#: /20 holds 4,091 addresses (AWS keeps 5 of a subnet's 4,096). A node takes one: its primary
#: interface; the interfaces on its other network cards are efa-only, with no address
#: (stacks/compute.py, network_interfaces). 1,024 nodes, as many replacements launching while
#: the nodes they replace still hold theirs, FSx for Lustre's interfaces and the endpoints fit
#: (tests/test_stacks_network.py).
CLUSTER_SUBNET_MASK = 20
PUBLIC_SUBNET_MASK = 24
LUSTRE_PORTS = (ec2.Port.tcp(988), ec2.Port.tcp_range(1018, 1023))

#: Interface endpoints the nodes need with no internet: Session Manager and Run Command (ssm,
#: ssmmessages, ec2messages), training logs (logs), the CloudWatch agent's and bootstrap's
#: metrics (monitoring), bootstrap's lifecycle hook calls (autoscaling) and the EC2 calls of the
#: CloudWatch agent and bootstrap (ec2: DescribeTags, DescribeVolumes).
INTERFACE_ENDPOINTS = {
    "AutoScalingEndpoint": ec2.InterfaceVpcEndpointAwsService.AUTOSCALING,
    "Ec2Endpoint": ec2.InterfaceVpcEndpointAwsService.EC2,
    "SsmEndpoint": ec2.InterfaceVpcEndpointAwsService.SSM,
    "SsmMessagesEndpoint": ec2.InterfaceVpcEndpointAwsService.SSM_MESSAGES,
    "Ec2MessagesEndpoint": ec2.InterfaceVpcEndpointAwsService.EC2_MESSAGES,
    "LogsEndpoint": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
    "MonitoringEndpoint": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_MONITORING,
}


class ClusterVpc(Construct):
    """A VPC whose subnets all sit in the configured Availability Zone ID."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        nat = config.internet_egress == "nat"
        subnets = [
            ec2.SubnetConfiguration(
                name="Cluster",
                subnet_type=(
                    ec2.SubnetType.PRIVATE_WITH_EGRESS if nat else ec2.SubnetType.PRIVATE_ISOLATED
                ),
                cidr_mask=CLUSTER_SUBNET_MASK,
            )
        ]
        if nat:
            subnets.insert(
                0,
                ec2.SubnetConfiguration(
                    name="Public",
                    subnet_type=ec2.SubnetType.PUBLIC,
                    cidr_mask=PUBLIC_SUBNET_MASK,
                    # Only the NAT gateway lives here, with its own Elastic IP.
                    map_public_ip_on_launch=False,
                ),
            )
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(VPC_CIDR),
            max_azs=1,
            nat_gateways=1 if nat else 0,
            subnet_configuration=subnets,
            restrict_default_security_group=True,
        )
        # The L2 Vpc places subnets by zone *name* (Fn::GetAZs); pin them to the zone ID instead,
        # which needs no account lookup at synth and names the same zone in every account.
        for subnet in [
            *self.vpc.public_subnets,
            *self.vpc.private_subnets,
            *self.vpc.isolated_subnets,
        ]:
            cfn_subnet = subnet.node.default_child
            assert isinstance(cfn_subnet, ec2.CfnSubnet)
            cfn_subnet.add_property_deletion_override("AvailabilityZone")
            cfn_subnet.add_property_override("AvailabilityZoneId", config.az_id)
        self.cluster_subnet = self.vpc.select_subnets(subnet_group_name="Cluster").subnets[0]
        if nat:
            acknowledge(
                self.vpc.public_subnets[0].node.find_child("DefaultRoute"),
                "NIST.800.53.R5-VPCNoUnrestrictedRouteToIGW",
                "The public subnet holds only the NAT gateway, which needs a route to the "
                "internet gateway; the nodes' private subnet routes through the NAT gateway.",
            )


class NetworkStack(cdk.Stack):
    """The VPC, endpoints, flow logs and the security groups of nodes and file system."""

    def __init__(
        self, scope: Construct, construct_id: str, *, config: ClusterConfig, **kwargs: Any
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.cluster_vpc = ClusterVpc(self, "Network", config=config)
        self.vpc = self.cluster_vpc.vpc
        self.cluster_subnet = self.cluster_vpc.cluster_subnet
        removal = cdk.RemovalPolicy.RETAIN if config.retain_data else cdk.RemovalPolicy.DESTROY

        self.efa_security_group = ec2.SecurityGroup(
            self,
            "EfaSecurityGroup",
            vpc=self.vpc,
            description=f"{config.cluster_name} nodes: EFA and collectives among themselves only",
            allow_all_outbound=False,
        )
        # EFA needs both: all traffic in from the group *and* all traffic out to the group.
        acknowledge(
            self.efa_security_group,
            "NIST.800.53.R5-EC2RestrictedCommonPorts",
            "The only inbound rule allows all traffic from this same security group, which EFA "
            "requires between the nodes; nothing outside the group may connect.",
        )
        self.efa_security_group.add_ingress_rule(
            self.efa_security_group, ec2.Port.all_traffic(), "EFA and collectives between nodes"
        )
        self.efa_security_group.add_egress_rule(
            self.efa_security_group, ec2.Port.all_traffic(), "EFA and collectives between nodes"
        )
        self.efa_security_group.add_egress_rule(
            ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "HTTPS to AWS APIs (endpoints, S3, NAT)"
        )
        if config.internet_egress == "nat":
            self.efa_security_group.add_egress_rule(
                ec2.Peer.any_ipv4(), ec2.Port.tcp(80), "HTTP to package mirrors through NAT"
            )

        self.fsx_security_group = ec2.SecurityGroup(
            self,
            "FsxSecurityGroup",
            vpc=self.vpc,
            description=f"{config.cluster_name} FSx for Lustre: Lustre from the nodes only",
            allow_all_outbound=False,
        )
        for port in LUSTRE_PORTS:
            self.fsx_security_group.add_ingress_rule(
                self.efa_security_group, port, "Lustre from the cluster nodes"
            )
            self.fsx_security_group.add_ingress_rule(
                self.fsx_security_group, port, "Lustre between file servers"
            )
            self.fsx_security_group.add_egress_rule(
                self.fsx_security_group, port, "Lustre between file servers"
            )
            self.fsx_security_group.add_egress_rule(
                self.efa_security_group, port, "Lustre replies to the cluster nodes"
            )
            self.efa_security_group.add_egress_rule(
                self.fsx_security_group, port, "Lustre to the file system"
            )
            # Lustre servers also open connections to the clients on these ports
            # (FSx for Lustre guide, "File system access control with Amazon VPC").
            self.efa_security_group.add_ingress_rule(
                self.fsx_security_group, port, "Lustre from the file system"
            )

        self.endpoint_security_group = ec2.SecurityGroup(
            self,
            "EndpointSecurityGroup",
            vpc=self.vpc,
            description=f"{config.cluster_name} VPC interface endpoints: HTTPS from the nodes",
            allow_all_outbound=False,
        )
        self.endpoint_security_group.add_ingress_rule(
            self.efa_security_group, ec2.Port.tcp(443), "HTTPS from the cluster nodes"
        )
        subnets = ec2.SubnetSelection(subnets=[self.cluster_subnet])
        self.vpc.add_gateway_endpoint(
            "S3Endpoint", service=ec2.GatewayVpcEndpointAwsService.S3, subnets=[subnets]
        )
        for endpoint_id, service in INTERFACE_ENDPOINTS.items():
            self.vpc.add_interface_endpoint(
                endpoint_id,
                service=service,
                subnets=subnets,
                private_dns_enabled=True,
                security_groups=[self.endpoint_security_group],
                open=False,
            )

        self.flow_log_key = kms.Key(
            self,
            "FlowLogKey",
            description=f"{config.cluster_name}: encrypts the VPC flow log group",
            enable_key_rotation=True,
            removal_policy=removal,
        )
        allow_cloudwatch_logs(self.flow_log_key)
        self.flow_log_group = logs.LogGroup(
            self,
            "FlowLogGroup",
            retention=retention(config.log_retention_days),
            encryption_key=self.flow_log_key,
            removal_policy=removal,
        )
        flow_log = self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(self.flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )
        acknowledge(
            flow_log,
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "The flow log role's inline policy is generated by aws-cdk-lib and allows writing "
            "to this one log group only.",
        )
