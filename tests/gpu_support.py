"""What the GPU-direct tests need, decided once: on a machine with a CUDA driver a missing kvikio
is a failure (the GPU-direct cold-read path would silently go untested); without one, a skip."""

import pytest


def require_kvikio():
    from torchreplay.storage import cuda_driver_present

    try:
        import kvikio
    except ImportError:
        if cuda_driver_present():
            pytest.fail("kvikio is not installed on a machine with a CUDA driver, so the GPU-direct path would go "
                        "untested: `make test` installs it there (pip install kvikio-cu13)")
        pytest.skip("kvikio needs a CUDA driver (none on this machine)")
    return kvikio
