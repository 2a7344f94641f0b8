#!/usr/bin/env python3
"""CDK app: the settings from context, the cluster's four stacks, the cdk-nag gate, synth.

Settings come from the cluster's settings file, clusters/<name>.yaml (`-c cluster=<name>` or
TRAINIUM_CLUSTER_NAME; default trainium), over the "context" block of cdk.json; without the file,
from cdk.json overridden with `-c key=value`. See stacks/settings_file.py, and stacks/config.py
for the keys and what each allows.
"""

from __future__ import annotations

import sys

import aws_cdk as cdk

from stacks.cluster import build_cluster
from stacks.config import ConfigError
from stacks.settings_file import config_from_app_context


def main() -> int:
    app = cdk.App()
    try:
        config = config_from_app_context(
            app.node.try_get_context, app.node.get_all_context().keys()
        )
    except ConfigError as error:
        # One line, and no synth: the CLI leaves no partial cloud assembly behind.
        print(f"error: {error}", file=sys.stderr)
        return 2
    build_cluster(app, config)
    app.synth()
    return 0


if __name__ == "__main__":
    sys.exit(main())
