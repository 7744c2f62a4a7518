"""Constrained decoding: a request's grammar (JSON Schema, Lark, regex) as a token mask that every
method applies alike, so constrained output is the same under every drafter (docs/structured-output.md)."""
from specdec.grammar.compiler import GrammarCompiler
from specdec.grammar.constraint import Constraint

__all__ = ["Constraint", "GrammarCompiler"]
