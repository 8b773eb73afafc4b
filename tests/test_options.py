"""The one parameter table (synapse_nb.options) and the CLI's option groups and flag table (cli/options.py).

Pure Python: nothing here loads a model or a kernel.
"""

from types import SimpleNamespace

import click
import pytest

from cli import options as O
from cli.common import AtLeast
from cli.main import llama_decode
from synapse_nb.options import FIELDS, I32_MAX, I32_MIN, KEYS, RUN, SAMPLING, U32_MAX


def _params():
    return {p.name: p for p in llama_decode.params}


def test_every_integer_option_has_a_range_that_fits_its_type():
    ints = [p for p in llama_decode.params if isinstance(p.type, (AtLeast, click.IntRange)) or p.type is click.INT]
    assert ints
    for p in ints:
        assert p.type is not click.INT, p.name  # unbounded
        lo, hi = (p.type.minimum, p.type.maximum) if isinstance(p.type, AtLeast) else (p.type.min, p.type.max)
        assert lo is not None and hi is not None and I32_MIN <= lo and hi <= U32_MAX, p.name
        assert hi <= I32_MAX or p.name == "seed", p.name


def test_cli_sampling_and_run_options_come_from_the_table():
    params = _params()
    for p in SAMPLING + RUN:
        opt = params[p.key]
        assert sorted(opt.opts) == sorted(p.flags)
        if p.kind == "int":
            assert (opt.type.minimum, opt.type.maximum) == (p.lo, p.hi)


def test_batch_keys_and_http_fields_come_from_the_table():
    from synapse_nb import api, batch, sampling

    assert batch.SAMPLING_KEYS == KEYS
    assert api.REQUEST_SAMPLING == FIELDS
    assert sampling.CLI_PARAMS == {p.key: "/".join(p.flags) for p in SAMPLING}
    assert {k: v for k, v in sampling.DEFAULTS.items() if k in KEYS} == {p.key: p.default for p in SAMPLING}


def _opts(**given):
    names = {name for name, _, _ in O.REFUSED}
    return SimpleNamespace(**{**dict.fromkeys(names), **given})


@pytest.mark.parametrize("mode,given,message", [
    ("chat", {"tokens": "1,2"}, "--tokens does not apply to -cnv/--conversation or -st/--single-turn"),
    ("batch", {"prompt": "hi"}, "PROMPT does not go with --batch (the prompts are the lines of IN)"),
    ("complete", {"system_prompt": "x"}, "-sys/--system-prompt and --chat-template-file apply to -cnv"),
    ("perplexity", {"grammar": "root ::= \"a\""}, "a grammar or JSON schema does not apply to --perplexity"),
    ("server", {"conversation": True}, "--server takes no prompt"),
    ("batch", {"replicas": 2}, "--replicas goes with --server --ray"),
])
def test_a_mode_refuses_what_the_table_says(mode, given, message):
    with pytest.raises(click.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        O.refuse_unused(mode, _opts(**given))


def test_a_mode_ignores_what_the_table_does_not_refuse():
    O.refuse_unused("perplexity", _opts(conversation=True, as_json=True))  # accepted, unused
    O.refuse_unused("complete", _opts(tokens="1", logits_out="x.npy", prefill_check=True))  # used
    assert set().union(*(modes for _, _, modes in O.REFUSED)) <= set(O.MODES)
