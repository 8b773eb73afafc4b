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

__all__ = ["Grammar", "GrammarMatcher", "parse_grammar", "decode_utf8", "json_schema_to_grammar"]


def json_schema_to_grammar(schema, force_gbnf: bool = True) -> str:
    """GBNF text for a JSON schema (a dict, or JSON text), as llama.cpp's json_schema_to_grammar."""
    from .schema import json_schema_to_grammar as _conv

    return _conv(schema)
