"""The quick demo, killed with SIGKILL right after the replay arm's first trainer checkpoint is
durable (see test_demo.py): a kill at a known point, instead of a parent racing the demo's end."""

import os
import signal
import sys

from torchreplay.demo import state

_save = state.TrainerCheckpoint.save


def save_then_die(self, saved):
    _save(self, saved)
    if "seed0-prior/" in self.store.uri:
        os.kill(os.getpid(), signal.SIGKILL)


state.TrainerCheckpoint.save = save_then_die

if __name__ == "__main__":
    from torchreplay.demo.__main__ import main

    sys.exit(main(sys.argv[1:]))
