"""Jinja extension of the template (cookiecutter.json `_extensions`): answers stay data.

Cookiecutter puts the template directory on sys.path and loads this extension into every Jinja
environment it makes: the one that computes the answers, the one that renders the files and the
ones that render the hooks. It does three things there.

1. Sandbox. An answer given on the command line or in an answers file (`--no-input key=value`,
   a replay file, `.cruft.json`) is itself rendered as a template, so `{{ ... __globals__ ... }}`
   in an answer could run Python. The environment gets Jinja's sandbox rules: attributes that
   start with '_' and Python internals are refused with a one-line error, before anything exists.
2. Check. The filter `check_answers` (the last entry of cookiecutter.json) runs the
   pre-generation checks on the answers while they are computed, before any folder is made.
3. Escape. Filters that turn an answer into a literal of the file's language:
   `toml_string`/`py_string` (a quoted TOML basic string or Python string literal),
   `docstring_text` (text inside a Python triple-quoted string), `md_text` (Markdown shows it
   as typed, never as markup).
"""

import importlib.util
import os
import re
import types
import unicodedata
from pathlib import Path

from cookiecutter.exceptions import FailedHookException
from jinja2.ext import Extension
from jinja2.sandbox import SandboxedEnvironment, SecurityError, safe_range

HERE = Path(__file__).resolve().parent
SHADOW_LIST = HERE / "hooks" / "shadowed_modules.txt"
SANDBOX_METHODS = (
    "is_safe_attribute", "is_safe_callable", "call_unop", "getitem", "getattr",
    "wrap_str_format",
)
MAX_EXPONENT = 64
MAX_POWER_BITS = 100_000
MAX_ANSWER_CHARS = 10_000
# Characters a string literal must not hold raw: controls, surrogates, line/paragraph separators.
ESCAPED_CATEGORIES = ("Cc", "Cs", "Zl", "Zp")
MARKDOWN_INLINE = re.compile(r"([\\`*_{}\[\]<>|~!])")
MARKDOWN_LINE_START = re.compile(r"^(\s*)([#>+=-]|\d+[.)])")


def _load_pre_gen():
    """The checks live in hooks/pre_gen_project.py (one source for both places they run)."""
    path = HERE / "hooks" / "pre_gen_project.py"
    spec = importlib.util.spec_from_file_location("lab_pre_gen", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PRE_GEN = _load_pre_gen()


def shadowed_modules() -> list[str]:
    lines = SHADOW_LIST.read_text().splitlines()
    return sorted(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def _refuse(message: str):
    # Cookiecutter's command line prints a FailedHookException as one line and exits 1.
    raise FailedHookException(f"error: {message}")


def check_answers(answers) -> str:
    error = PRE_GEN.check_answers(dict(answers), frozenset(shadowed_modules()))
    if error:
        _refuse(error)
    return ""


def _escape_char(char: str) -> str:
    simple = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    if char in simple:
        return simple[char]
    if unicodedata.category(char) in ESCAPED_CATEGORIES:
        code = ord(char)
        # TOML has no escape for a lone surrogate: it becomes U+FFFD (the checks refuse it anyway).
        return "\\uFFFD" if 0xD800 <= code <= 0xDFFF else f"\\u{code:04X}"
    return char


def quoted_string(value) -> str:
    """A double-quoted literal valid as a TOML basic string, a Python string and a JSON string:
    the three share the escapes used here (\\\\ \\" \\n \\t \\r \\uXXXX)."""
    return '"' + "".join(_escape_char(c) for c in str(value)) + '"'


def docstring_text(value) -> str:
    """Text that can sit inside a Python triple-quoted string: every quote and backslash escaped,
    line breaks kept (wordwrap adds them)."""
    return "".join(c if c == "\n" else _escape_char(c) for c in str(value))


def md_text(value) -> str:
    """Markdown that shows the text as typed: inline markup characters and a block marker at the
    start of the line escaped with a backslash."""
    text = MARKDOWN_INLINE.sub(r"\\\1", str(value))
    return MARKDOWN_LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), text)


class AnswersExtension(Extension):
    def __init__(self, environment):
        super().__init__(environment)
        _sandbox(environment)
        environment.filters.update(
            check_answers=check_answers, toml_string=quoted_string, py_string=quoted_string,
            docstring_text=docstring_text, md_text=md_text,
        )
        environment.globals["shadowed_modules"] = shadowed_modules()
        # Cookiecutter renders hooks inside the template directory (work_in(repo_dir)), so this
        # is where the template is even when it was named by a relative path.
        environment.globals["render_dir"] = os.getcwd()


def _bounded_width(jinja_filter):
    def bounded(value, width=80, *args, **kwargs):
        if isinstance(width, int) and width > MAX_ANSWER_CHARS:
            _refuse(f"an answer asks for a width of {width}: answers are text, not code")
        return jinja_filter(value, width, *args, **kwargs)

    return bounded


def _sandbox(environment) -> None:
    """Give a cookiecutter environment the rules of Jinja's SandboxedEnvironment.

    The compiled templates route every attribute access, item access and call through these
    methods once `sandboxed` is set; refusals become one-line errors instead of tracebacks."""
    environment.sandboxed = True
    for name in SANDBOX_METHODS:
        method = getattr(SandboxedEnvironment, name)
        setattr(environment, name, types.MethodType(method, environment))
    # Repetition and powers can exhaust memory or time from one short answer ('a' * 10**10):
    # they pass through call_binop, which refuses results above a size an answer never needs.
    environment.intercepted_binops = frozenset({"*", "**"})
    environment.intercepted_unops = SandboxedEnvironment.intercepted_unops
    environment.binop_table = SandboxedEnvironment.default_binop_table.copy()
    environment.unop_table = SandboxedEnvironment.default_unop_table.copy()

    def call_binop(context, operator, left, right):
        # A power has about bit_length * exponent bits: bound that, not only the exponent.
        if (operator == "**" and isinstance(left, int) and isinstance(right, int)
                and (abs(right) > MAX_EXPONENT
                     or abs(left).bit_length() * abs(right) > MAX_POWER_BITS)):
            _refuse(f"an answer raises to the power {right}: answers are text, not code")
        if operator == "*":
            sizes = [len(x) for x in (left, right) if isinstance(x, (str, list, tuple))]
            counts = [x for x in (left, right) if isinstance(x, int)]
            if sizes and counts and sizes[0] * max(counts[0], 0) > MAX_ANSWER_CHARS:
                _refuse("an answer repeats text past the length any answer may have")
        return environment.binop_table[operator](left, right)

    def bounded_range(*args):
        try:
            return safe_range(*args)
        except OverflowError:
            _refuse(f"an answer asks for range{args}: answers are text, not code")

    environment.call_binop = call_binop
    environment.globals["range"] = bounded_range
    # Filters and globals whose size argument turns a short answer into gigabytes.
    lipsum = environment.globals["lipsum"]

    def bounded_lipsum(n=5, *args, **kwargs):
        if isinstance(n, int) and n > 10:
            _refuse(f"an answer asks for {n} paragraphs: answers are text, not code")
        return lipsum(n, *args, **kwargs)

    environment.globals["lipsum"] = bounded_lipsum
    for name in ("center", "indent"):
        environment.filters[name] = _bounded_width(environment.filters[name])

    def unsafe_undefined(obj, attribute):
        kind = type(obj).__name__
        _refuse(f"an answer uses {attribute!r} of a {kind}: answers are text, not code")

    def call(context, obj, *args, **kwargs):
        try:
            return SandboxedEnvironment.call(environment, context, obj, *args, **kwargs)
        except SecurityError as error:
            _refuse(f"an answer calls something it may not ({error})")

    environment.unsafe_undefined = unsafe_undefined
    environment.call = call

