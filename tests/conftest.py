import os

import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    slow_enabled = os.environ.get("TORCHREPLAY_SLOW", "0") == "1"
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (none on this machine)"))
        if "slow" in item.keywords and not slow_enabled:
            item.add_marker(pytest.mark.skip(reason="stress/scale run: set TORCHREPLAY_SLOW=1"))


@pytest.fixture(scope="session")
def s3_server():
    """A loopback S3 server (moto) behind a fault-injecting proxy, with dummy credentials."""
    import os

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from s3server import S3Server

    server = S3Server()
    yield server
    server.close()


@pytest.fixture
def s3_bucket(s3_server, request):
    import uuid

    import boto3

    server = s3_server
    server.faults.fail_next = 0
    server.faults.fail_only = ""
    server.faults.delay_s = 0.0
    if server.moto is None:
        server.start_moto()
    name = f"tr-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=name)
    yield name


def pytest_terminal_summary(terminalreporter):
    """Count the CUDA tests that did not run, so a GPU run that silently skips shows up."""
    skipped = terminalreporter.stats.get("skipped", [])
    cuda = [r for r in skipped if "cuda" in getattr(r, "keywords", {})]
    if cuda or CUDA:
        where = "a CUDA device is present" if CUDA else "no CUDA device here"
        terminalreporter.write_line(f"torchreplay: {len(cuda)} CUDA test(s) skipped ({where})")
