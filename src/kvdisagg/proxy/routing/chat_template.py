"""What vLLM's serving layer reads from a chat template, without importing vLLM: the content
format it renders messages in, and the variables it lets request kwargs set.

Ported from vllm/renderers/hf.py (vLLM 0.32, Apache-2.0): ``_detect_content_format`` and the
helpers it walks the Jinja AST with, and ``resolve_chat_template_kwargs``.
tests/unit/proxy/test_tokens.py checks the port against vLLM's own functions on every template
vLLM ships, so a vLLM upgrade that changes them fails there. Used by tokens.py only.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.nodes

__all__ = ["ContentFormat", "accepted_kwargs", "detect_content_format"]

ContentFormat = Literal["string", "openai"]


def _parse(chat_template: str) -> jinja2.nodes.Template | None:
    import transformers.utils.chat_template_utils as hf_chat_utils

    try:
        compiled = hf_chat_utils._compile_jinja_template(chat_template)
        root: jinja2.nodes.Template = compiled.environment.parse(chat_template)
        return root
    except Exception:
        return None


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var_access(node.node, varname) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str,
                            key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assigns_of(root: jinja2.nodes.Node, varname: str) -> Iterator[str]:
    yield varname
    related = deque([varname])
    while related:
        name = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, name):
                assert isinstance(assign.target, jinja2.nodes.Name)
                yield assign.target.name
                if assign.target.name != name:
                    related.append(assign.target.name)


def _message_vars(root: jinja2.nodes.Node) -> Iterator[str]:
    messages = list(_assigns_of(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        for varname in messages:
            if _is_var_or_elems_access(loop.iter, varname):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop.target.name
                break


def _content_loops(root: jinja2.nodes.Node) -> Iterator[str]:
    message_vars = list(_message_vars(root))
    content_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(
                            _is_var_or_elems_access(arg, v, "content") for v in message_vars):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if (isinstance(kw, jinja2.nodes.Keyword) and kw.key in param_names
                            and any(_is_var_or_elems_access(kw.value, v, "content")
                                    for v in message_vars)):
                        content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                content_params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        for v in message_vars:
            if _is_var_or_elems_access(loop.iter, v, "content"):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop.target.name
                break
        else:
            params = content_params_by_loop.get(id(loop))
            if (isinstance(loop.iter, jinja2.nodes.Name) and params is not None
                    and loop.iter.name in params):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop.target.name
                continue
            if (id(loop) not in loops_in_macros and isinstance(loop.iter, jinja2.nodes.Name)
                    and loop.iter.name == "content"):
                assert isinstance(loop.target, jinja2.nodes.Name)
                yield loop.target.name


@lru_cache(maxsize=32)
def detect_content_format(chat_template: str) -> ContentFormat:
    """``openai`` if the template loops over a message's content (parts as dicts), else
    ``string`` (parts joined with newlines), as vLLM's ``--chat-template-content-format auto``."""
    root = _parse(chat_template)
    if root is None:
        return "string"
    try:
        next(_content_loops(root))
    except StopIteration:
        return "string"
    except Exception:
        return "string"
    return "openai"


@lru_cache(maxsize=32)
def _template_vars(chat_template: str) -> frozenset[str]:
    root = _parse(chat_template)
    return frozenset() if root is None else frozenset(jinja2.meta.find_undeclared_variables(root))


@lru_cache(maxsize=1)
def _hf_base_params() -> frozenset[str]:
    from transformers import PythonBackend

    sig = inspect.signature(PythonBackend.apply_chat_template)
    return frozenset(p.name for p in sig.parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


@lru_cache(maxsize=32)
def _method_params(cls: Any) -> frozenset[str]:
    """``_named_params`` of the bound method, per class (``inspect.signature`` costs more than
    the rest of a request's tokenization)."""
    return _named_params(cls.apply_chat_template) - {"self"}


def _named_params(fn: Any) -> frozenset[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in sig.parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def accepted_kwargs(tokenizer: Any, chat_template: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs vLLM passes on to ``apply_chat_template``: those the tokenizer's method
    names, the template reads, or HF's base method names (``resolve_chat_template_kwargs``)."""
    cls: Any = type(tokenizer)
    accept = (_method_params(cls) | _template_vars(chat_template)
              | _hf_base_params()) - {"chat_template", "tokenize"}
    return {k: v for k, v in kwargs.items() if k in accept}
