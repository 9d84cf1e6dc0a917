"""The package's top-level names, and that importing it stays light."""

from __future__ import annotations

import subprocess
import sys

from petals_chain.swarm.local import REPO_ROOT


def test_top_level_import_is_the_client_class():
    import petals_chain
    from petals_chain import (
        AutoDistributedModelForCausalLM,
        DistributedModelForCausalLM,
    )
    from petals_chain.client.model import DistributedModelForCausalLM as Direct

    assert DistributedModelForCausalLM is Direct and AutoDistributedModelForCausalLM is Direct
    assert "DistributedModelForCausalLM" in dir(petals_chain)


def test_unknown_top_level_name_is_an_attribute_error():
    import petals_chain

    try:
        petals_chain.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_import_and_cli_help_do_not_load_torch():
    code = (
        "import sys, petals_chain, petals_chain.cli.main; petals_chain.cli.main.main(['--help']); "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False"
