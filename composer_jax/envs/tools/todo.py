"""The agent's plan: a numbered todo list kept in the episode (the `todo` tool's state).

It lives with the episode's tools, so an environment snapshot carries it and the final step
reports it (`as_json`): the behaviour reward for unfinished items reads what the agent left open.
"""

from __future__ import annotations

import dataclasses

MAX_ITEMS = 32
MAX_TEXT = 200


@dataclasses.dataclass
class TodoItem:
    text: str
    done: bool = False


class TodoList:
    """Items numbered from 1 in creation order; `apply` is the tool, errors are ValueErrors."""

    ACTIONS = ("create", "update", "complete", "list")

    def __init__(self, items: list[TodoItem] | None = None):
        self.items = list(items or [])

    def apply(self, action: str, text: str | None, item_id: int | None) -> str:
        if action == "list":
            return self.render()
        if action == "create":
            item = TodoItem(self._text(text))
            if len(self.items) >= MAX_ITEMS:
                raise ValueError(f"the list is full ({MAX_ITEMS} items)")
            self.items.append(item)
            return f"created item {len(self.items)}\n{self.render()}"
        item = self._item(item_id)
        if action == "update":
            item.text = self._text(text)
            return f"updated item {item_id}\n{self.render()}"
        item.done = True
        return f"completed item {item_id}\n{self.render()}"

    def _text(self, text: str | None) -> str:
        text = (text or "").strip()
        if not text:
            raise ValueError("give the item's `text`")
        if len(text) > MAX_TEXT:
            raise ValueError(f"an item's text has at most {MAX_TEXT} characters")
        return text

    def _item(self, item_id: int | None) -> TodoItem:
        if item_id is None:
            raise ValueError("give the item's `id`")
        if not 1 <= item_id <= len(self.items):
            raise ValueError(f"no item {item_id} (the list has {len(self.items)})")
        return self.items[item_id - 1]

    def render(self) -> str:
        if not self.items:
            return "(no items)"
        return "\n".join(
            f"{i}. [{'x' if item.done else ' '}] {item.text}"
            for i, item in enumerate(self.items, 1)
        )

    @property
    def unfinished(self) -> int:
        return sum(not item.done for item in self.items)

    def as_json(self) -> list[dict]:
        return [dataclasses.asdict(item) for item in self.items]

    @classmethod
    def from_json(cls, data: list[dict]) -> TodoList:
        return cls([TodoItem(str(item["text"]), bool(item["done"])) for item in data])
