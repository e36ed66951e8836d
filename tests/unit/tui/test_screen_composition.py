"""The main screen's collaborators share one context, and the screen keeps no method that
only hands work to one of them (issue 38, item 4). Reads the classes; starts no app."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from kvchat.tui.main import context
from kvchat.tui.main.attachments import Attachments
from kvchat.tui.main.branching import Branching
from kvchat.tui.main.drafts import Drafts
from kvchat.tui.main.idle_work import IdleWork
from kvchat.tui.main.message_actions import MessageActions
from kvchat.tui.main.model_switch import ModelSwitch
from kvchat.tui.main.opener import SessionOpener
from kvchat.tui.main.screen import MainScreen
from kvchat.tui.main.session_actions import SessionActions
from kvchat.tui.main.session_feed import SessionFeed
from kvchat.tui.main.turns import TurnRunner
from kvchat.tui.main.watch import SessionWatch

COLLABORATORS = (
    Attachments,
    Branching,
    Drafts,
    IdleWork,
    MessageActions,
    ModelSwitch,
    SessionOpener,
    SessionActions,
    SessionFeed,
    TurnRunner,
    SessionWatch,
)
# What a collaborator may take beside the context: the collaborators it calls.
OTHER_COLLABORATORS = {"opener", "idle_work"}


@pytest.mark.parametrize("cls", COLLABORATORS, ids=lambda c: c.__name__)
def test_each_collaborator_takes_the_screen_context_and_only_other_collaborators(
    cls: type,
) -> None:
    params = list(inspect.signature(cls.__init__).parameters)
    assert params[:2] == ["self", "ctx"]
    assert set(params[2:]) <= OTHER_COLLABORATORS


def _handles_a_message(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``@on(...)``: where the screen takes a Message, not a forwarder."""
    return any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "on"
        for d in fn.decorator_list
    )


def _only_hands_on(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """The body (its docstring aside) is one call of a collaborator's method, awaited or
    not: ``self.<collaborator>.<method>(...)``."""
    body = [
        s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    if len(body) != 1 or not isinstance(body[0], (ast.Expr, ast.Return)):
        return False
    value = body[0].value
    if isinstance(value, ast.Await):
        value = value.value
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return False
    owner = value.func.value
    return (
        isinstance(owner, ast.Attribute)
        and isinstance(owner.value, ast.Name)
        and owner.value.id == "self"
        and owner.attr not in {"state", "prompt", "app", "conversation", "sessions", "status"}
    )


def test_the_screen_keeps_no_forwarder_but_the_actions_textual_bindings_call() -> None:
    tree = ast.parse(textwrap.dedent(inspect.getsource(MainScreen)))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    forwarders = [
        fn.name
        for fn in cls.body
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _only_hands_on(fn)
        and not _handles_a_message(fn)
    ]
    assert forwarders, "the check finds the action_* forwarders Textual needs"
    assert [name for name in forwarders if not name.startswith("action_")] == []


def test_every_kind_of_work_has_its_own_worker_name() -> None:
    jobs = [v for v in vars(context).values() if isinstance(v, context.Job)]
    assert len(jobs) >= 10
    assert len({job.name for job in jobs}) == len(jobs)
