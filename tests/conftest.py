"""Test harness: `async def` tests run on a fresh uvloop event loop, and fail on anything the loop reports
as unhandled (a task's exception never retrieved, an error in a callback) and on tasks left running."""

from __future__ import annotations

import asyncio
import gc
import inspect

import pytest
import uvloop


def _run_async_test(fn, kwargs) -> None:
    problems: list[str] = []

    def handler(loop, context) -> None:
        exc = context.get("exception")
        problems.append(f"{context.get('message')}: {exc!r}" if exc else str(context.get("message")))

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(handler)
        await fn(**kwargs)
        await asyncio.sleep(0)
        me = asyncio.current_task()
        left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if left:
            problems.append(
                "tasks left running after the test: " + ", ".join(repr(t.get_coro()) for t in left)
            )
            for t in left:
                t.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
        gc.unfreeze()  # what the page index froze as it grew (hicached.daemon.l2.index) is looked at here too
        gc.collect()
        runner.get_loop().run_until_complete(asyncio.sleep(0))
    if problems:
        pytest.fail("event loop reported unhandled problems:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        _run_async_test(pyfuncitem.obj, kwargs)
        return True
    return None


@pytest.fixture(autouse=True)
def _gc_unfrozen():
    """The page index freezes the objects alive as it grows (gc.freeze, hicached.daemon.l2.index): a test's
    objects go back to the collector after it, so that no test keeps another's garbage."""
    yield
    gc.unfreeze()
