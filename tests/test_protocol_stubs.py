"""hivemind builds a servicer's stub class lazily on the first get_stub, and not thread-safely (the
soak test once lost a session to "'NoneType' object is not callable" when two threads asked first).
petals_chain.transport.protocol builds both stub classes at import, under the import lock."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_protocol_builds_both_stub_classes():
    # a fresh interpreter, so no earlier get_stub in this test process can have built them
    code = (
        "import petals_chain.transport.protocol as p\n"
        "print(p.BlockService._stub_type is not None, p.OrchestratorService._stub_type is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_first_stubs_from_many_threads_at_once():
    code = (
        "import threading\n"
        "from hivemind.p2p import PeerID\n"
        "from petals_chain.transport.protocol import BlockService, OrchestratorService\n"
        "peer = PeerID.from_base58('QmSwuCzywcxNfG4R76jt2sdSJRFBtUPRFPcxj7C2bchx6y')\n"
        "go, errors = threading.Barrier(16), []\n"
        "def first_stub(cls):\n"
        "    go.wait()\n"
        "    try:\n"
        "        stub = cls.get_stub(None, peer)\n"
        "        assert callable(stub.rpc_info if cls is BlockService else stub.rpc_acquire)\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "ts = [threading.Thread(target=first_stub, args=((BlockService, OrchestratorService)[i % 2],)) for i in "
        "range(16)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(errors or 'ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr[-2000:]
