"""The mocker: the engine's scheduler and block manager with a timing model in place of the
model, so that routing, disaggregation and planning run at scale with no model and no GPU."""

from kvbaton.mocker.runner import MockerRunner, create_mocker_engine
from kvbaton.mocker.timing import MockerTiming

__all__ = ["MockerRunner", "MockerTiming", "create_mocker_engine"]
