"""Where model cards live in discovery: `/models/{namespace}/{name}/{instance_id:x}`, each owned
by the lease of the worker that registered it (docs/architecture.md). A model name may contain
'/'; the instance id is the last segment."""

from __future__ import annotations

MODELS_ROOT = "/models/"


def model_cards_prefix(namespace: str) -> str:
    return f"{MODELS_ROOT}{namespace}/"


def model_card_key(namespace: str, name: str, instance_id: int) -> str:
    return f"{model_cards_prefix(namespace)}{name}/{instance_id:x}"


def parse_model_card_key(namespace: str, key: str) -> tuple[str, int] | None:
    """(model name, instance id) from a key under the namespace's prefix; None for any other."""
    prefix = model_cards_prefix(namespace)
    if not key.startswith(prefix):
        return None
    name, _, instance = key[len(prefix) :].rpartition("/")
    try:
        return (name, int(instance, 16)) if name else None
    except ValueError:
        return None
