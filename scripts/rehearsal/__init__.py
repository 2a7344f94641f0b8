"""The local rehearsal of the cluster's AWS side: `cluster.py rehearse` and the tests' stand-ins.

It runs the operator's own code (scripts/cluster_lib) against local stand-ins for AWS: network
namespaces for the nodes (hosts.py), instances laid out like the Neuron DLAMI with a node agent
each (instances.py, node_agent.py), the SSM agent's rules (ssm_agent/), boto3 calls answered
locally (aws_stand_in.py, ssm_stand_in.py, logs_stand_in.py), the job supervisor's state
machine in moto (supervisor.py), and the rehearsal itself (runner.py, direct.py).

This package depends on scripts/cluster_lib; nothing there imports it (tests/test_layout.py).
"""
