"""A page of a list of items, as the API's item lists page them (a stored response's input
items, a conversation's items): ``limit`` items in ``order`` (``asc``: oldest first) after
the item whose id is ``after`` (400 naming ``after`` when no item has it); no ``include`` is
served (400 naming it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Query

from splitserve.gateway.errors import invalid


@dataclass
class PageQuery:
    """A list route's query parameters (a FastAPI dependency: ``Annotated[PageQuery,
    Depends()]``)."""

    limit: int = Query(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
    include: list[str] | None = Query(None)


def page(
    items: list[dict[str, Any]],
    limit: int,
    order: Literal["asc", "desc"] = "asc",
    after: str | None = None,
) -> dict[str, Any]:
    """The ``list`` object of the page (``first_id``, ``last_id``, ``has_more``)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid(f"no item {after!r} in this list", "after")
        start = ids.index(after) + 1
    chosen = ordered[start : start + limit]
    return {
        "object": "list",
        "data": chosen,
        "first_id": chosen[0]["id"] if chosen else None,
        "last_id": chosen[-1]["id"] if chosen else None,
        "has_more": start + limit < len(ordered),
    }


def refuse_include(include: list[str] | None) -> None:
    """400 naming ``include`` where one is asked (no extras are served for items)."""
    if include:
        raise invalid("no include is served for these items", "include")


def asked_page(items: list[dict[str, Any]], query: PageQuery) -> dict[str, Any]:
    """The page ``query`` asks for."""
    refuse_include(query.include)
    return page(items, query.limit, query.order, query.after)
