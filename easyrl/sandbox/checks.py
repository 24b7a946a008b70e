"""Assert-form tests (MBPP, HumanEval style: ``assert f(3) == 9``) whose verdict the program cannot forge.

Such a test used to pass whenever the program exited with status 0, so a program that ended itself before the
asserts ran (``sys.exit(0)``, ``os._exit(0)``, an ``atexit`` hook, a signal to itself, closing stdout) or returned
an object whose ``__eq__`` always answers True scored full marks. The verdict is now taken out of its hands:

- this (trusted) process splits each assert into the operands of its top-level comparison (``f(3)`` and ``9``
  with ``==``; ``a and b`` into two checks; a bare ``assert x`` or ``assert not x`` into a truth test), and each
  operand into the calls that reach the program (``f(x)``, ``Solution().f(x)``: every largest expression rooted
  at a name that is not a builtin or a standard module) and what the test does with them;
- the program's run executes the code, then evaluates only those calls and writes each value on one line tagged
  with a random marker, encoded from exact builtin types only (``type(x) is int``, never ``isinstance``: a subclass
  that overrides an operator is refused; ``Counter`` and namedtuples read as dict and tuple). Functions the program
  defines are wrapped so that what they return must be such a plain value too;
- a second run that holds no program code evaluates the rest (``abs(<value of f(x)> - 2.5) < 1e-9``,
  ``set([4, 5])``, ``math.isclose(...)``) on those values, now fresh builtin objects; literals are read here with
  ``ast.literal_eval``. No expected value enters the program's run, and what it returns meets only builtins;
- this process applies each comparison to the decoded values. A value whose line is missing (the program ended
  early), repeated (the program printed one too) or malformed fails the test.

A program that prints a value line itself, or tampers with the harness through its frames, must still produce the
value its own call should return, which is solving the test. Left in the program's run: an operand that wraps its
calls in a lambda or comprehension (evaluated whole there), and a setup line's variable it names
(``expected = [1]; assert f(1) == expected``), which it could read.
"""

from __future__ import annotations

import ast
import builtins
import itertools
import operator
import secrets
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from easyrl.sandbox.local import SandboxResult


__all__ = ["AssertProgram", "assert_program"]

_MAX_DEPTH = 64  # nesting of a reported value (deeper is refused both here and in the sandbox)
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}

# Runs in the sandbox. Everything it needs is bound before the program's code runs, so a program that replaces
# `exec`, `print`, `repr` or `sys.stdout` changes nothing here; values go out on a copy of fd 1 taken first.
_HARNESS = r"""
def _easyrl_harness(code, steps, marker, modules):
    import builtins, os, sys, types
    write, dup, tasks = os.write, os.dup, os.listdir
    _type, _repr, _hex, _len, _exec, _eval, _compile = type, repr, hex, len, exec, eval, compile
    _str, _list, _function, _base = str, list, types.FunctionType, BaseException
    out = dup(1)
    builtin_names = dict(builtins.__dict__)
    stdlib = {}
    for name in modules:
        try:
            stdlib[name] = __import__(name)
        except ImportError:
            pass
    saved = {name: dict(module.__dict__) for name, module in stdlib.items()}
    plain_atoms = (type(None), bool, int, float, complex, str, bytes)
    plain_boxes = (list, tuple, set, frozenset, dict)
    import collections
    trusted = (collections.Counter, collections.OrderedDict, collections.defaultdict)  # read as dict
    mro_of, dict_of = type.__dict__["__mro__"].__get__, type.__dict__["__dict__"].__get__
    operators = frozenset({"__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__len__",
                 "__iter__", "__contains__", "__getitem__", "__getattribute__", "__getattr__", "__index__",
                 "__int__", "__float__", "__complex__", "__abs__", "__neg__", "__pos__", "__round__", "__str__",
                 "__format__", "__add__", "__sub__", "__mul__", "__truediv__", "__floordiv__", "__mod__",
                 "__pow__", "__radd__", "__rsub__", "__rmul__", "__rtruediv__", "__rfloordiv__", "__rmod__",
                 "__rpow__", "__and__", "__or__", "__xor__", "__rand__", "__ror__", "__rxor__", "__invert__",
                 "__lshift__", "__rshift__", "__matmul__", "keys", "items", "values"})

    def one_of(t, group):
        # By identity: `in` would ask the program's metaclass `__eq__` whether its class is `int`.
        for member in group:
            if t is member:
                return member
        return None

    def base_of(t):
        # The builtin type a value is read as: its own when plain; a standard dict subclass (Counter, ...) as
        # dict; a subclass (a namedtuple) as its builtin base only when it overrides no operator, since the
        # test's own expression may apply one to it. `type`'s own descriptors: a metaclass cannot lie here.
        if one_of(t, trusted) is not None:
            return dict
        for cls in mro_of(t):
            found = one_of(cls, plain_atoms) or one_of(cls, plain_boxes)
            if found is not None:
                return found
            if any(_type(name) is _str and name in operators for name in dict_of(cls)):
                return None
        return None

    def encode(x, depth):
        t = base_of(_type(x))
        if depth > DEPTH or t is None:
            raise TypeError("not a plain value: " + _type(x).__name__)
        if t is int:
            return "('i'," + _repr(_hex(int.__index__(x))) + ")"
        if t is float:
            return "('f'," + _repr(float.__repr__(x)) + ")"
        if t is complex:
            return "('c'," + _repr(complex.__repr__(x)) + ")"
        if one_of(t, plain_atoms) is not None:
            return "('a'," + t.__repr__(x) + ")"
        if t is dict:
            pairs = dict.items(x)
            inner = ",".join("(" + encode(k, depth + 1) + "," + encode(v, depth + 1) + ")" for k, v in pairs)
        else:
            inner = ",".join(encode(v, depth + 1) for v in t.__iter__(x))
        return "(" + _repr(t.__name__) + ",[" + inner + "])"

    iterators = (types.GeneratorType, map, filter, zip, enumerate, reversed)

    def plain_items(iterator):
        for item in iterator:
            encode(item, 0)
            yield item

    def plain(fn):
        def checked(*args, **kwargs):
            value = fn(*args, **kwargs)
            if one_of(_type(value), iterators) is not None:
                return plain_items(value)  # `list(f(x))` in a test: each item must be plain
            encode(value, 0)  # raises for anything but a plain value: its methods are the program's own
            return value
        return checked

    main = types.ModuleType("__main__")  # the program's own `__main__` (pickle finds its functions there)
    sys.modules["__main__"] = main
    g = main.__dict__
    g["__builtins__"] = builtins
    _exec(_compile(code, "<solution>", "exec"), g)
    builtins.__dict__.update(builtin_names)  # builtins the program replaced are restored
    for name, module in stdlib.items():
        module.__dict__.update(saved[name])  # and so are the functions of the standard modules the tests name
    ns = {k: (plain(v) if _type(v) is _function else v) for k, v in g.items()}
    for name in builtin_names:
        ns.pop(name, None)  # a program's own `abs` or `set` does not stand in for the builtin in a test
    ns.update(stdlib)
    for step in steps:
        kind, body, listed = step
        if _len(tasks("/proc/self/task")) != 1:
            write(out, ("\n" + marker + " threads\n").encode())
            break  # a thread of the program's could tamper with the checks: nothing more is reported
        sys.settrace(None)
        sys.setprofile(None)
        if kind == "exec":
            _exec(_compile(body, "<test>", "exec"), ns)
            continue
        try:
            value = _eval(_compile(body, "<test>", "eval"), ns)
            if listed and one_of(_type(value), iterators) is not None:
                value = _list(value)  # a call the clean run goes on with (`list(f(x))`): its items, each checked
            line = encode(value, 0)
        except _base:
            line = "!"
        write(out, ("\n" + marker + " " + _str(kind) + " " + line + "\n").encode())
"""


@dataclass(frozen=True)
class _Operand:
    value: Any = None
    expr: int | None = None  # index of the sandbox expression that gives it; None: ``value`` is a literal


@dataclass(frozen=True)
class _Check:
    ops: tuple[str, ...]  # comparison operator names (ast class names), or ("truthy",) / ("falsy",)
    operands: tuple[_Operand, ...]


@dataclass(frozen=True)
class AssertProgram:
    """One assert statement turned into a program to run, a second run without the program where needed, and a
    verdict read from what they report."""

    source: str
    """The program's code, then the harness evaluating the operands (or parts of operands) that call into it."""
    marker: str
    checks: tuple[_Check, ...]
    exprs: frozenset[int]
    """What the program's run must report: values of calls into the program (``f(x)``, ``Solution().f(x)``)."""
    clean_steps: tuple[tuple[int, str, bool], ...]
    """Operands evaluated by a run that holds no program code: expected values (``set([4, 5])``) and what a test
    does with the program's values (``abs(_easyrl_v3 - 2.5)``, with ``_easyrl_v3`` the value ``f(x)`` reported)."""
    chains: tuple[int, ...]
    """The reported values the clean run is given, as ``_easyrl_v<index>``."""
    modules: tuple[str, ...]

    def judge(self, run: Callable[[str], SandboxResult]) -> tuple[bool, list[SandboxResult]]:
        """Run the program (and the clean run when there is one) with ``run``; whether the test passed, and every
        run's result."""
        results = [run(self.source)]
        values = _reported(results[0].stdout, self.marker, self.exprs) if results[0].status == "ok" else None
        if values is None:
            return False, results  # an operand missing, repeated or malformed, or the program failed
        if self.clean_steps:
            bindings = "".join(f"_easyrl_v{index} = {_literal(values[index], 0)}\n" for index in self.chains)
            clean = f"{_harness()}\n_easyrl_harness({bindings!r}, {self.clean_steps!r}, {self.marker!r}, "
            results.append(run(clean + f"{self.modules!r})\n"))
            expected = frozenset(index for index, _, _ in self.clean_steps)
            reported = _reported(results[1].stdout, self.marker, expected) if results[1].status == "ok" else None
            if reported is None:
                return False, results
            values.update(reported)
        return all(_holds(check, values) for check in self.checks), results


def _harness() -> str:
    return _HARNESS.replace("DEPTH", str(_MAX_DEPTH))


def _literal(value: Any, depth: int) -> str:
    """Python source for a decoded plain value (``float('inf')`` where ``repr`` would not read back)."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deep")
    if type(value) is float:
        return f"float({repr(value)!r})"
    if type(value) is complex:
        return f"complex({repr(value)!r})"
    if type(value) in (list, tuple, set, frozenset):
        items = ", ".join(_literal(item, depth + 1) for item in value)
        return f"{type(value).__name__}([{items}])"
    if type(value) is dict:
        return "{" + ", ".join(f"{_literal(k, depth + 1)}: {_literal(v, depth + 1)}" for k, v in value.items()) + "}"
    return repr(value)  # None, bool, int, str, bytes: exact builtin types, whose repr reads back


def _reported(stdout: str, marker: str, expected: frozenset[int]) -> dict[int, Any] | None:
    """The decoded value of each operand in ``expected`` from a run's stdout; ``None`` unless each is there once."""
    values: dict[int, Any] = {}
    for line in stdout.splitlines():
        if not line.startswith(marker + " "):
            continue
        index, _, encoded = line[len(marker) + 1 :].partition(" ")
        if not index.isdigit() or int(index) in values or int(index) not in expected or encoded == "!":
            return None  # a repeat means the program printed a line of its own; "!" an operand raised
        try:
            values[int(index)] = _decode(ast.literal_eval(encoded), 0)
        except Exception:  # malformed or deeper than allowed: the program wrote it, not the harness
            return None
    return values if len(values) == len(expected) else None  # one missing: the program ended before it ran


def _decode(encoded: Any, depth: int) -> Any:
    """Fresh builtin objects from the harness's tagged encoding; raises on anything else."""
    if depth > _MAX_DEPTH or type(encoded) is not tuple or len(encoded) != 2:
        raise ValueError("malformed value")
    tag, payload = encoded
    if tag == "i" and type(payload) is str:
        return int(payload, 16)
    if tag == "f" and type(payload) is str:
        return float(payload)
    if tag == "a" and type(payload) in (type(None), bool, str, bytes):
        return payload
    if tag == "c" and type(payload) is str:
        return complex(payload)
    if tag == "dict" and type(payload) is list:
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in payload}
    boxes: dict[str, Callable[[Any], Any]] = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}
    if tag in boxes and type(payload) is list:
        return boxes[tag](_decode(item, depth + 1) for item in payload)
    raise ValueError(f"unknown tag {tag!r}")


def _holds(check: _Check, values: dict[int, Any]) -> bool:
    found = [values[o.expr] if o.expr is not None else o.value for o in check.operands]
    try:
        if check.ops == ("truthy",):
            return bool(found[0])
        if check.ops == ("falsy",):
            return not found[0]
        return all(_COMPARE[getattr(ast, op)](a, b) for op, a, b in zip(check.ops, found, found[1:]))
    except Exception:  # `<` between a list and an int, say: the assert would have raised
        return False


def _split(test: ast.expr) -> list[tuple[tuple[str, ...], list[ast.expr]]]:
    """The checks one assert's test stands for, as (operators, operand nodes)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [check for value in test.values for check in _split(value)]
    if isinstance(test, ast.Compare) and all(type(op) in _COMPARE for op in test.ops):
        return [(tuple(type(op).__name__ for op in test.ops), [test.left, *test.comparators])]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return [(("falsy",), [test.operand])]
    return [(("truthy",), [test])]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _modules(tree: ast.AST) -> list[str]:
    """Standard modules the test uses as modules (``math`` in ``math.isclose(...)``): the harness imports them
    before the program runs and gives the test the real ones. A standard name the test calls (``array(3)``) is left
    to the program, which may define a function of that name."""
    bases = {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    return sorted(bases & set(sys.stdlib_module_names))


_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr)


class _Chains(ast.NodeTransformer):
    """Replaces each largest expression rooted at a name the program (or a setup line) may define (``f(x)``,
    ``Solution().f(x)``, ``p.a``, ``x``) by ``_easyrl_v<index>``, collecting (index, source) of each."""

    def __init__(self, standard: set[str], counter: Iterator[int]) -> None:
        self.standard, self.counter = standard, counter
        self.found: list[tuple[int, str, bool]] = []

    def rooted(self, node: ast.AST) -> bool:
        while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and node.id not in self.standard

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)) and self.rooted(node):
            index = next(self.counter)
            self.found.append((index, ast.unparse(node), True))  # True: an iterator it gives is reported as a list
            return ast.copy_location(ast.Name(id=f"_easyrl_v{index}", ctx=ast.Load()), node)
        return self.generic_visit(node)


def _operand(
    node: ast.expr, standard: set[str], counter: Iterator[int], steps: list[tuple[Any, str, bool]], clean: list[Any]
) -> _Operand:
    """Where one operand is evaluated: here (a literal), by the clean run (nothing of the program's in it, or only
    the values its calls reported), or whole by the program's run (a lambda or comprehension around its names)."""
    try:
        return _Operand(value=ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    chains = _Chains(standard, counter)
    if _names(node) <= standard or not (any(isinstance(n, _SCOPED) for n in ast.walk(node)) or chains.rooted(node)):
        skeleton = chains.visit(ast.parse(ast.unparse(node), mode="eval").body)  # a copy: the tree is kept
        steps += chains.found
        index = next(counter)
        clean.append((index, ast.unparse(skeleton), False))
        return _Operand(expr=index)
    index = next(counter)
    steps.append((index, ast.unparse(node), False))
    return _Operand(expr=index)


def _inline_check(tree: ast.Module) -> ast.Module:
    """HumanEval's form, ``def check(candidate): assert candidate(1) == 2 ...`` then ``check(f)``: its body at the
    top level with ``candidate`` named ``f``, so that each of its asserts is verified like any other."""
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check" and len(n.args.args) == 1]
    calls = [
        n
        for n in tree.body
        if isinstance(n, ast.Expr)
        and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Name)
        and n.value.func.id == "check"
        and [type(a) for a in n.value.args] == [ast.Name]
    ]
    if len(defs) != 1 or len(calls) != 1:
        return tree
    param, entry = defs[0].args.args[0].arg, calls[0].value.args[0].id  # type: ignore[attr-defined]
    for node in ast.walk(defs[0]):
        if isinstance(node, ast.Name) and node.id == param:
            node.id = entry
    body: list[ast.stmt] = []
    for node in tree.body:
        body += defs[0].body if node is defs[0] else [] if node is calls[0] else [node]
    return ast.Module(body=body, type_ignores=[])


def assert_program(code: str, statement: str) -> AssertProgram:
    """The program that checks ``statement`` (assert statements, with any setup lines between them) against
    ``code``; raises ``ValueError`` naming the statement when it holds no top-level ``assert``."""
    try:
        tree = ast.parse(statement)
    except SyntaxError as error:
        raise ValueError(f"code reward: assert test is not Python ({error.msg}): {statement[:200]!r}") from None
    tree = _inline_check(tree)
    if not any(isinstance(node, ast.Assert) for node in tree.body):
        raise ValueError(
            f"code reward: an assert test must hold top-level `assert` statements (or HumanEval's `def check"
            f"(candidate)` and `check(f)`); got {statement[:200]!r}"
        )
    top = {id(node) for node in tree.body}
    if any(isinstance(node, ast.Assert) and id(node) not in top for node in ast.walk(tree)):
        raise ValueError(
            "code reward: only top-level `assert` statements can be verified; unroll the loop or function that holds "
            f"one into top-level asserts: {statement[:200]!r}"
        )
    modules = _modules(tree)
    standard = set(dir(builtins)) | set(modules)
    steps: list[tuple[Any, str, bool]] = []  # the program's run: (expression index or "exec", source, as a list)
    clean: list[tuple[int, str, bool]] = []  # the clean run
    checks, counter = [], itertools.count()
    for node in tree.body:
        if not isinstance(node, ast.Assert):
            steps.append(("exec", ast.unparse(node), False))
            continue
        for ops, operand_nodes in _split(node.test):
            operands = tuple(_operand(operand, standard, counter, steps, clean) for operand in operand_nodes)
            checks.append(_Check(ops, operands))
    marker = f"@@easyrl-check-{secrets.token_hex(8)}@@"
    source = f"{_harness()}\n_easyrl_harness({code!r}, {tuple(steps)!r}, {marker!r}, {tuple(modules)!r})\n"
    exprs = frozenset(index for index, _, _ in steps if index != "exec")
    return AssertProgram(source, marker, tuple(checks), exprs, tuple(clean), tuple(sorted(exprs)), tuple(modules))
