"""The bad-input fuzzers (issues 18 and 34), importable by the tests and run from the repository root:

    python -m fuzz.gguf --n 10000 [--seed S]               # mutated GGUF files and vocabularies
    python -m fuzz.inputs --kind template|batch|flags --n 2000 [--seed S]

`gguf` and `inputs` make the cases; `harness` holds what both share: the outcome classes, the
per-case limits (peak RSS 2 GiB, 30 s) and their measurement, the workers' address-space cap and
llama-decode run in-process. Not part of the installed package.
"""
