"""A cluster's settings file: `clusters/<cluster_name>.yaml`, read by the CDK app and the CLI.

CDK context given with `-c key=value` is not stored anywhere, so a later `npx cdk deploy --all`
without it synthesizes cdk.json's defaults and undoes a Capacity Block's settings. The settings
of a cluster therefore live in one file per cluster, as AWS ParallelCluster keeps a cluster's
definition in its cluster configuration file (ParallelCluster user guide, "Cluster
configuration file", YAML) and compares it with the deployed cluster's settings at every update
("Using pcluster update-cluster"; here `trainium-cluster deploy`, scripts/cluster_lib/deploy.py).

The file is a flat YAML mapping with cdk.json's context keys (ClusterConfig's fields), not
ParallelCluster's nested sections: the same names as `-c key=value`, cdk.json and the error
messages, validated by the same code. A key the file leaves out has cdk.json's value. The app
picks the file with `-c cluster=<name>` or TRAINIUM_CLUSTER_NAME (the CLI's variable), default
`trainium`; without the file the cluster is cdk.json's defaults, as before. A `-c key=value`
that differs from the file is refused: the file is the one place a setting is changed.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import yaml

from stacks.config import TIME_FORMAT, ClusterConfig, ConfigError, _parse

#: The project's root: app.py, cdk.json and the clusters/ folder.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
SETTINGS_FOLDER = "clusters"
#: The context key and the environment variable that name the cluster (and so its file).
CLUSTER_CONTEXT_KEY = "cluster"
CLUSTER_ENVIRONMENT = "TRAINIUM_CLUSTER_NAME"
DEFAULT_CLUSTER = "trainium"


def settable() -> list[str]:
    """The settings' names: ClusterConfig's fields, cdk.json's context keys."""
    return [f.name for f in fields(ClusterConfig) if f.init]


def checkout_root() -> Path:
    """Where the CLI finds clusters/ and cdk.json: the current directory when it is a checkout
    (it holds cdk.json), else the checkout this code runs from (an editable install's)."""
    cwd = Path.cwd()
    return cwd if (cwd / "cdk.json").is_file() else PROJECT_ROOT


_DEFAULTS = {f.name: f.default for f in fields(ClusterConfig) if f.init}


def settings_path(cluster_name: str, root: Path = PROJECT_ROOT) -> Path:
    return root / SETTINGS_FOLDER / f"{cluster_name}.yaml"


def cluster_name_from(context_value: object, environ: Mapping[str, str]) -> str:
    """The cluster a command is for: `-c cluster=`, else TRAINIUM_CLUSTER_NAME, else the
    default."""
    return str(context_value or environ.get(CLUSTER_ENVIRONMENT) or DEFAULT_CLUSTER)


def _shown(path: Path) -> str:
    """A settings file as messages name it: clusters/<name>.yaml."""
    return f"{SETTINGS_FOLDER}/{path.name}"


def read_settings(path: Path) -> dict[str, Any]:
    """The file's settings as written (unparsed); one line for a file that is not a mapping of
    settings to single values."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or "not YAML"
        raise ConfigError(
            f"{_shown(path)}{where}: {problem}; allowed: a YAML mapping of settings, one "
            "`key: value` a line"
        ) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"{_shown(path)} is not a mapping; allowed: one `key: value` a line, with the keys of "
            "cdk.json's context"
        )
    names = settable()
    for key, value in loaded.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"{_shown(path)}: {key} is not a setting{hint}; allowed: {', '.join(names)}"
            )
        if isinstance(value, datetime) and value.tzinfo is not None:
            # YAML reads an unquoted 2026-12-01T11:30:00Z as a timestamp: the same instant,
            # written back as the settings write it.
            loaded[key] = value.astimezone(UTC).strftime(TIME_FORMAT)
            continue
        if isinstance(value, dict | list | date) or value is None:
            raise ConfigError(
                f"{_shown(path)}: {key} has no single value; allowed: a string, number or "
                "true/false (a time in UTC with its Z, such as 2026-12-01T11:30:00Z)"
            )
    return dict(loaded)


def load_cluster(cluster_name: str, root: Path = PROJECT_ROOT) -> ClusterConfig | None:
    """The cluster's settings from its file over cdk.json's defaults; None without a file."""
    path = settings_path(cluster_name, root)
    if not path.is_file():
        return None
    return _config(path, cluster_name, _cdk_json_context(root))


def config_from_app_context(
    get: Callable[[str], Any],
    present_keys: Iterable[str],
    *,
    root: Path = PROJECT_ROOT,
    environ: Mapping[str, str] = os.environ,
) -> ClusterConfig:
    """The app's settings: the cluster's file over cdk.json, or cdk.json's context as before
    when the file does not exist. `get` and `present_keys` are the app's context."""
    keys = [k for k in present_keys if k != CLUSTER_CONTEXT_KEY]
    given_name = get(CLUSTER_CONTEXT_KEY) or environ.get(CLUSTER_ENVIRONMENT)
    name = cluster_name_from(given_name, environ)
    path = settings_path(name, root)
    if not path.is_file():
        if given_name and name != DEFAULT_CLUSTER:
            raise ConfigError(
                f"cluster={name} has no settings file {_shown(path)}; allowed: "
                f"create it (cluster_name: {name}, and the settings that differ from "
                "cdk.json's), or a cluster whose file exists"
            )
        return ClusterConfig.from_context(get, keys)
    defaults = _cdk_json_context(root)
    config = _config(path, name, defaults)
    # What the command line adds: context that differs from cdk.json's (-c values are
    # strings; cdk.json's are JSON types). A -c value the file agrees with is harmless.
    for key in keys:
        if key not in settable():
            continue
        raw = get(key)
        if key in defaults and raw == defaults[key] and type(raw) is type(defaults[key]):
            continue
        value = _parse(key, raw, _DEFAULTS[key])
        if value != getattr(config, key):
            raise ConfigError(
                f"-c {key}={raw} contradicts {_shown(path)} ({key}: "
                f"{getattr(config, key)!r}); allowed: edit the file, which every later deploy "
                "reads (a -c value is not stored)"
            )
    return config


def _cdk_json_context(root: Path) -> dict[str, Any]:
    path = root / "cdk.json"
    if not path.is_file():
        return {}
    context: dict[str, Any] = json.loads(path.read_text()).get("context", {})
    return {k: v for k, v in context.items() if k in settable()}


def _config(path: Path, name: str, defaults: Mapping[str, Any]) -> ClusterConfig:
    written = read_settings(path)
    if written.get("cluster_name", name) != name:
        raise ConfigError(
            f"{_shown(path)} says cluster_name: {written['cluster_name']}; allowed: {name}, "
            "the file's name (one file per cluster)"
        )
    values = {**defaults, **written, "cluster_name": name}
    try:
        return ClusterConfig.from_context(values.get, values)
    except ConfigError as error:
        raise ConfigError(f"{_shown(path)}: {error}") from None


def settings_record(config: ClusterConfig) -> str:
    """The settings a deploy was made with, as the operations stack records them (its output
    `Settings`): compact JSON of every setting, for `trainium-cluster deploy` to compare."""
    return json.dumps({k: getattr(config, k) for k in settable()}, separators=(",", ":"))
