"""llama-decode MODEL --batch IN --output OUT [--workers N] [--ray [ADDRESS]]: batch mode.

Only checks the flags and calls synapse_nb.batch.run_file, which does the work (and its logs).
"""

from __future__ import annotations

import click

from .options import refuse_unused


def run(o) -> int:
    """Batch mode with o, the command's options (cli.main); returns the exit status."""
    if o.batch_in is None or o.batch_out is None:
        raise click.UsageError("batch mode needs both --batch IN.jsonl and --output OUT.jsonl")
    refuse_unused("batch", o)
    if o.n_predict < 0:  # a batch line always has a limit (-1 is for one interactive run)
        raise click.BadParameter("must be >= 0", param_hint="-n/--n-predict")
    from synapse_nb.batch import run_file
    from synapse_nb.grammar import grammar_from_options
    from synapse_nb.sampling import given_options

    return run_file(o.model, o.batch_in, o.batch_out, workers=o.workers, n_threads=o.n_threads,
                    ray_address=o.ray_address, n_parallel=o.n_parallel or 1, n_predict=o.n_predict,
                    grammar=grammar_from_options(**o.grammar_opts), n_ctx=o.n_ctx, n_batch=o.n_batch,
                    ignore_eos=o.ignore_eos, add_special=not o.no_add_special, parse_special=not o.no_parse_special,
                    sampling=given_options(o.sampling) or None)
