"""The jinja2 environment chat templates render in: transformers' sandbox, with the work bounded.

A chat template is untrusted code from the artifact. transformers' sandbox
(``ImmutableSandboxedEnvironment``) bounds what a template may *touch*; this module also bounds
how much *work* one rendering may do, so that a template of nested loops over ``range(100000)``
or one that renders 20 MB ends at once with one ``RequestError`` instead of running for hours:

- every iteration of every ``{% for %}`` (the loop's iterable is wrapped in a counting guard by
  an AST pass before compiling), every call a template makes and every ``+ * ** ~`` it evaluates
  is a *step*; a rendering has at most ``RenderLimits.max_steps`` of them and, checked on the way,
  at most ``max_seconds`` of wall time;
- the output is produced piece by piece (``Template.generate``) and stops past ``max_chars``;
  ``*`` and ``**`` are checked *before* they compute (``'x' * 10**9`` never allocates), ``~`` and
  ``+`` results and namespace assignments are checked for size, and a call whose integer
  argument exceeds ``max_chars`` (``'x'.ljust(10**9)``, ``|center(10**9)``) is refused.

The limits are far above what a real chat template needs (thousands of messages render in
milliseconds) and are fields of :class:`RenderLimits`, so a caller may widen them.
jinja2 is imported only when a template is compiled.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from loopcast.errors import ArtifactError, RequestError

_GUARD_FILTER = "loopcast_counted"  # wraps every for-loop's iterable (added by the AST pass)
_SIZE_FILTER = "loopcast_sized"  # wraps every ~ concatenation
_CHECK_EVERY = 256  # steps between two looks at the clock
# the width and precision of a printf-style field (%10.3f, %(name)5s) and a str.format spec ({:>10})
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*([0-9]*)(?:\.([0-9]*))?[a-zA-Z%]")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_NUMBER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class RenderLimits:
    """How much work one chat-template rendering may do."""

    max_seconds: float = 2.0
    max_chars: int = 4 * 1024 * 1024  # of the rendered prompt, and of any one string on the way
    max_steps: int = 1_000_000  # loop iterations, calls and operators together

    def __post_init__(self) -> None:
        if not (self.max_seconds > 0 and self.max_chars > 0 and self.max_steps > 0):
            raise RequestError(f"render limits must be positive, got {self}")


class _Budget:
    """One rendering's running count of steps, characters and time."""

    def __init__(self, limits: RenderLimits, origin: str) -> None:
        self.limits, self.origin = limits, origin
        self.steps = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def fail(self, what: str) -> RequestError:
        return RequestError(
            f"{self.origin}: the chat template {what}; rendering stopped (a template's work is "
            f"bounded: {self.limits.max_seconds:g} s, {self.limits.max_chars} characters, "
            f"{self.limits.max_steps} steps)",
            parameter="messages",
        )

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.limits.max_steps:
            raise self.fail(f"ran more than {self.limits.max_steps} steps (loop iterations and calls)")
        if self.steps % _CHECK_EVERY < n:
            self.clock()

    def clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.fail(f"ran longer than {self.limits.max_seconds:g} s")

    def sized(self, value: object) -> object:
        if _weight(value, self.limits.max_chars) > self.limits.max_chars:
            raise self.fail(f"built a value of more than {self.limits.max_chars} characters or items")
        return value

    def widths(self, fmt: str, braces: bool = False) -> None:
        """A format string (printf-style, or str.format's with ``braces``) whose field widths or
        precisions would exceed the size limit; other numbers in its text do not count."""
        if braces:
            numbers = [n for spec in _BRACE_SPEC.findall(fmt) for n in _NUMBER.findall(spec)]
        else:
            numbers = [n for field in _PERCENT_FIELD.findall(fmt) for n in field if n]
        for digits in numbers:
            if len(digits) > 12 or int(digits) > self.limits.max_chars:
                raise self.fail(f"formats with a width of {digits}")

    def counted(self, iterable: Iterable) -> Iterator:
        for item in iterable:
            self.step()
            yield item


def _weight(value: object, limit: int) -> int:
    """Characters and items in ``value`` (strings inside lists counted), up to just past ``limit``:
    what joining, printing or serializing it would cost."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, (list, tuple)):
        return 0
    total = len(value)
    for item in value:
        if total > limit:
            break
        if isinstance(item, (str, bytes, list, tuple)):
            total += _weight(item, limit - total)
    return total


def render_bounded(template, limits: RenderLimits, **variables) -> str:
    """Render a template compiled by :func:`compile_template` within ``limits``."""
    budget: _Budget = template.environment.loopcast_budget
    budget.deadline = time.monotonic() + limits.max_seconds  # the clock starts at rendering
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece)
        if size > limits.max_chars:
            raise budget.fail(f"rendered more than {limits.max_chars} characters")
        pieces.append(piece)
        budget.step()
    return "".join(pieces)


def compile_template(source: str, origin: str, limits: RenderLimits):
    """``source`` compiled in a fresh bounded sandbox (one per rendering: the budget is its own)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    budget = _Budget(limits, origin)

    class GenerationBlock(Extension):
        # transformers marks assistant spans with {% generation %}; here it renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        # no underscore attributes: keeps templates away from Python internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            budget.sized(value)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            budget.step()
            if operator == "%" and isinstance(left, str):
                budget.widths(left)
                if "*" in left:  # a width taken from the arguments: '%*s' % (10**9, 'x')
                    for value in right if isinstance(right, tuple) else (right,):
                        if isinstance(value, int) and value > limits.max_chars:
                            raise budget.fail(f"formats with a width of {value}")
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                        if _weight(seq, limits.max_chars) * max(times, 0) > limits.max_chars:
                            raise budget.fail(
                                f"multiplies a sequence of {len(seq)} by {times} (past "
                                f"{limits.max_chars} characters or items)"
                            )
            if operator == "**" and isinstance(left, int) and isinstance(right, int):
                if abs(left) > 1 and right * max(abs(left), 2).bit_length() > 64 * 1024:
                    raise budget.fail(f"raises {left} to the power {right} (too large a number)")
            return budget.sized(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value):
            # str.format / format_map reached from a template: their field widths are sizes too
            if getattr(value, "__name__", None) in ("format", "format_map"):
                owner = getattr(value, "__self__", None)
                if isinstance(owner, str):
                    budget.widths(owner, braces=True)
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            budget.step()
            name = getattr(__obj, "__name__", "a function")
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_chars:
                    raise budget.fail(f"calls {name} with {value}")
            return budget.sized(super().call(__context, __obj, *args, **kwargs))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def width_checked(name: str):
        # filters whose integer arguments size their output (|center(10**9))
        inner = jinja2.filters.FILTERS[name]

        @functools.wraps(inner)  # keeps jinja2's pass_environment mark (truncate, wordwrap)
        def checked(value, *args, **kwargs):
            if name == "format" and isinstance(value, str):
                budget.widths(value)
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, int) and not isinstance(arg, bool) and arg > limits.max_chars:
                    raise budget.fail(f"asks |{name} for a width of {arg}")
            return budget.sized(inner(value, *args, **kwargs))

        return checked

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.loopcast_budget = budget  # type: ignore[attr-defined]  # read by render_bounded
    env.filters["tojson"] = tojson
    for name in ("center", "indent", "wordwrap", "truncate", "batch", "slice", "format"):
        env.filters[name] = width_checked(name)
    env.filters[_GUARD_FILTER] = budget.counted
    env.filters[_SIZE_FILTER] = budget.sized
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ArtifactError(
            f"{origin}: chat template does not parse (line {exc.lineno}: {exc.message})"
        ) from None
    _guard(tree, nodes)
    return env.from_string(tree)


def _guard(tree, nodes) -> None:
    """Wrap every loop's iterable in the step counter and every ``~`` in the size check."""

    def wrap(node, name):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    for loop in tree.find_all(nodes.For):
        loop.iter = wrap(loop.iter, _GUARD_FILTER)
    for parent in list(tree.find_all(nodes.Node)):
        for field in parent.fields:
            value = getattr(parent, field, None)
            if isinstance(value, nodes.Concat):
                setattr(parent, field, wrap(value, _SIZE_FILTER))
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, nodes.Concat):
                        value[i] = wrap(item, _SIZE_FILTER)
