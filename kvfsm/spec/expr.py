"""The guard and invariant expression language: a tiny, parsed (never `eval`-ed) language over counters.

Grammar::

    expr := conj ('or' conj)*
    conj := unary ('and' unary)*
    unary := 'not' unary | '(' expr ')' | cmp | 'true' | 'false'
    cmp  := sum ('==' | '!=' | '<' | '<=' | '>' | '>=') sum
    sum  := atom (('+' | '-') atom)*
    atom := COUNTER | INT

Kept this small on purpose: it can be enumerated (nondeterminism and inductive-invariant checks),
rendered to Python (the generator) and to text (auditor docs) without surprises. Its trees are walked
recursively, so the parser bounds them (kvfsm.input_limits: EXPR_MAX_NESTING levels of `not` and
parentheses, EXPR_MAX_TERMS atoms in a sum, EXPR_MAX_DIGITS in a literal), an ExprError past either.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

from kvfsm.input_limits import EXPR_MAX_DIGITS, EXPR_MAX_NESTING, EXPR_MAX_TERMS


class ExprError(ValueError):
    """A malformed expression; `column` is 1-based within the expression text."""

    def __init__(self, message: str, column: int) -> None:
        super().__init__(f"{message} (column {column})")
        self.column = column


@dataclass(frozen=True)
class Num:
    value: int


@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Arith:
    op: str  # '+' | '-'
    left: Term
    right: Term


@dataclass(frozen=True)
class Cmp:
    op: str
    left: Term
    right: Term


@dataclass(frozen=True)
class BoolOp:
    op: str  # 'and' | 'or'
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Not:
    item: Node


@dataclass(frozen=True)
class Const:
    value: bool


Term = Union[Num, Var, Arith]
Node = Union[Cmp, BoolOp, Not, Const]

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>==|!=|<=|>=|<|>|\+|-|\(|\)))")
_CMP_OPS = ("==", "!=", "<=", ">=", "<", ">")
_KEYWORDS = ("and", "or", "not", "true", "false")


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens: list[tuple[str, str, int]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            col = pos + len(text[pos:]) - len(text[pos:].lstrip()) + 1
            raise ExprError(f"unexpected character {text[col - 1]!r}", col)
        kind = m.lastgroup or ""
        tokens.append((kind, m.group(kind), m.start(kind) + 1))
        pos = m.end()
    tokens.append(("end", "", len(text) + 1))
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.i = 0
        self.nesting = 0  # `not`s and parentheses open around the current token

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.i]

    def take(self) -> tuple[str, str, int]:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def expect(self, value: str) -> None:
        kind, text, col = self.take()
        if text != value:
            raise ExprError(f"expected {value!r}, found {text or 'end of expression'!r}", col)

    def parse(self) -> Node:
        node = self.disj()
        kind, text, col = self.peek()
        if kind != "end":
            raise ExprError(f"unexpected {text!r}", col)
        return node

    def disj(self) -> Node:
        items = [self.conj()]
        while self.peek()[1] == "or":
            self.take()
            items.append(self.conj())
        return items[0] if len(items) == 1 else BoolOp("or", tuple(items))

    def conj(self) -> Node:
        items = [self.unary()]
        while self.peek()[1] == "and":
            self.take()
            items.append(self.unary())
        return items[0] if len(items) == 1 else BoolOp("and", tuple(items))

    def _enter(self, col: int) -> None:
        self.nesting += 1
        if self.nesting > EXPR_MAX_NESTING:
            raise ExprError(f"nested deeper than {EXPR_MAX_NESTING} levels of `not` and parentheses", col)

    def unary(self) -> Node:
        kind, text, col = self.peek()
        if text == "not":
            self.take()
            self._enter(col)
            node: Node = Not(self.unary())
            self.nesting -= 1
            return node
        if text in ("true", "false"):
            self.take()
            return Const(text == "true")
        if text == "(":
            self.take()
            self._enter(col)
            node = self.disj()
            self.expect(")")
            self.nesting -= 1
            return node
        left = self.sum()
        kind, text, col = self.take()
        if text not in _CMP_OPS:
            raise ExprError(f"expected a comparison, found {text or 'end of expression'!r}", col)
        return Cmp(text, left, self.sum())

    def sum(self) -> Term:
        node = self.atom()
        terms = 1
        while self.peek()[1] in ("+", "-"):
            op, col = self.take()[1:]
            terms += 1
            if terms > EXPR_MAX_TERMS:
                raise ExprError(f"a sum of more than {EXPR_MAX_TERMS} terms", col)
            node = Arith(op, node, self.atom())
        return node

    def atom(self) -> Term:
        kind, text, col = self.take()
        if kind == "num":
            if len(text) > EXPR_MAX_DIGITS:
                raise ExprError(f"a literal of more than {EXPR_MAX_DIGITS} digits", col)
            return Num(int(text))
        if kind == "name" and text not in _KEYWORDS:
            return Var(text)
        raise ExprError(f"expected a counter or an integer, found {text or 'end of expression'!r}", col)


def parse(text: str) -> Node:
    """Parse `text` into an expression tree; raise ExprError with a column on bad input."""
    return _Parser(str(text)).parse()


def names(node: Node | Term) -> set[str]:
    """The counter names an expression mentions."""
    if isinstance(node, Var):
        return {node.name}
    if isinstance(node, (Arith, Cmp)):
        return names(node.left) | names(node.right)
    if isinstance(node, BoolOp):
        return set().union(*(names(i) for i in node.items))
    if isinstance(node, Not):
        return names(node.item)
    return set()


def literals(node: Node | Term) -> set[int]:
    """Integer literals, used to size the bounded enumeration of counter valuations."""
    if isinstance(node, Num):
        return {node.value}
    if isinstance(node, (Arith, Cmp)):
        return literals(node.left) | literals(node.right)
    if isinstance(node, BoolOp):
        return set().union(*(literals(i) for i in node.items))
    if isinstance(node, Not):
        return literals(node.item)
    return set()


_CMP: dict[str, Callable[[int, int], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def evaluate(node: Node | Term, env: Mapping[str, int]) -> int | bool:
    """Evaluate over a counter valuation (used by the reference interpreter and the checks)."""
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Var):
        return env[node.name]
    if isinstance(node, Arith):
        a, b = evaluate(node.left, env), evaluate(node.right, env)
        return a + b if node.op == "+" else a - b
    if isinstance(node, Cmp):
        return _CMP[node.op](evaluate(node.left, env), evaluate(node.right, env))
    if isinstance(node, BoolOp):
        if node.op == "and":
            return all(evaluate(i, env) for i in node.items)
        return any(evaluate(i, env) for i in node.items)
    if isinstance(node, Not):
        return not evaluate(node.item, env)
    return node.value


def render(node: Node | Term, var: Callable[[str], str] = lambda n: n) -> str:
    """Render as source text; `var` maps a counter to its spelling (e.g. `self.copies`)."""
    if isinstance(node, Num):
        return str(node.value)
    if isinstance(node, Var):
        return var(node.name)
    if isinstance(node, Arith):
        return f"{render(node.left, var)} {node.op} {render(node.right, var)}"
    if isinstance(node, Cmp):
        return f"{render(node.left, var)} {node.op} {render(node.right, var)}"
    if isinstance(node, BoolOp):
        return f" {node.op} ".join(
            f"({render(i, var)})" if isinstance(i, BoolOp) else render(i, var) for i in node.items
        )
    if isinstance(node, Not):
        inner = render(node.item, var)
        return f"not ({inner})" if isinstance(node.item, (BoolOp, Cmp)) else f"not {inner}"
    return "True" if node.value else "False"
