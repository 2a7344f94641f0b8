"""boto3 Sessions for the stand-ins, sharing one botocore data loader per process.

Every new boto3 Session has a loader of its own, so its first client reads and parses the
service's model (EC2's service-2.json is several MB), its endpoint rules and its paginators
again: a rehearsal makes a Session for every CLI call it answers, and a profile of one
two-job rehearsal found 39 s of its 95 s of CPU in json.loads under botocore's loader. The
loader's answers are read-only data cached per loader (botocore.loaders.instance_cache), so
sessions made here share one. boto3 appends its own data folder to a session's loader on every
Session (boto3.session.Session._setup_loader): the shared loader's search paths are kept free
of the repeats.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_lock = threading.Lock()


@functools.cache
def shared_loader() -> Any:
    """This process's botocore Loader for the stand-ins' sessions."""
    from botocore.loaders import create_loader

    return create_loader()


def stand_in_session(key: str, region: str) -> Any:
    """A boto3 Session with fixed credentials whose loader is the shared one."""
    import boto3
    import botocore.session

    with _lock:
        core = botocore.session.get_session()
        loader = shared_loader()
        core.register_component("data_loader", loader)
        session = boto3.Session(
            aws_access_key_id=key,
            aws_secret_access_key=key,
            region_name=region,
            botocore_session=core,
        )
        loader.search_paths[:] = list(dict.fromkeys(loader.search_paths))
    return session
