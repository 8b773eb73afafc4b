"""Structured output: GBNF grammars and JSON schemas, token for token as llama.cpp.

  gbnf      the GBNF parser (llama_grammar_parser) and llama.cpp's checks of a grammar
  matcher   Grammar (parsed, flattened) and GrammarMatcher (the allowed tokens per step,
            accepting a token), with llama.cpp's stack semantics
  schema    JSON schema -> GBNF as common/json-schema-to-grammar.cpp

Usage::

    from synapse_nb.grammar import Grammar, GrammarMatcher
    m = GrammarMatcher(Grammar(open("json.gbnf").read()), model.tokenizer)
    sampler = synapse_nb.Sampler(temp=0.8, seed=42, grammar=m)
"""

from .gbnf import parse_grammar
from .matcher import Grammar, GrammarMatcher, decode_utf8

from .schema import json_schema_to_grammar

__all__ = ["Grammar", "GrammarMatcher", "parse_grammar", "decode_utf8", "json_schema_to_grammar",
           "grammar_from_options"]

_MAX_FILE = 64 << 20  # a grammar or schema file larger than this is refused (not read into memory)


def _read_text(path: str, what: str) -> str:
    import os

    from ..errors import SynapseError
    from ..inputs import check_regular_file

    check_regular_file(path, what)
    try:
        if os.path.getsize(path) > _MAX_FILE:
            raise SynapseError(f"{what} {path}: larger than {_MAX_FILE >> 20} MiB")
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE + 1)
    except OSError as e:
        raise SynapseError(f"{what} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SynapseError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def grammar_from_options(grammar=None, grammar_file=None, json_schema=None, json_schema_file=None):
    """The GBNF text llama.cpp's flags give (--grammar, --grammar-file, -j/--json-schema,
    -jf/--json-schema-file), or None when none (or an empty grammar, which llama.cpp ignores).
    At most one may be given; a schema is converted with json_schema_to_grammar. Raises
    SynapseError (one line, naming the flag) for an unreadable file, bad JSON or a refused schema;
    the grammar itself is checked when it is compiled (Grammar)."""
    from ..errors import SynapseError

    given = [(flag, v) for flag, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                       ("-j/--json-schema", json_schema), ("-jf/--json-schema-file", json_schema_file))
             if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise SynapseError(f"{given[0][0]} and {given[1][0]} both give the grammar: give one of them")
    flag, value = given[0]
    if flag == "--grammar-file":
        value = _read_text(value, flag)
    elif flag == "-jf/--json-schema-file":
        value = _read_text(value, flag)
    if flag in ("-j/--json-schema", "-jf/--json-schema-file"):
        try:
            value = json_schema_to_grammar(value)
        except SynapseError as e:
            hint = ""
            if flag == "-j/--json-schema" and value.strip().isdigit():
                hint = " (-j is llama.cpp's --json-schema; worker processes are --workers N)"
            raise SynapseError(f"{flag}: {e}{hint}") from None
    if not isinstance(value, str):
        raise SynapseError(f"{flag}: expected text, got {type(value).__name__}")
    return value or None
