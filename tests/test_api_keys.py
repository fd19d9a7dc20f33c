"""``ApiKeys``: the keys file's format, tenants, and who a presented key names (no servers;
the ports that use it are tested outside-in in ``test_public_security.py``)."""

from __future__ import annotations

import pytest

from splitserve.common.api_keys import ANONYMOUS, ApiKeys

FILE = """
# production keys
sk-alpha-1   team-a
sk-alpha-2   team-a   # a second key of the same tenant
sk-beta
"""


def test_a_keys_file_names_tenants_and_a_bare_key_is_its_own_tenant() -> None:
    keys = ApiKeys.parse(FILE.splitlines(), flag_keys=["sk-flag"])
    first, second = keys.caller_of("Bearer sk-alpha-1"), keys.caller_of("bearer sk-alpha-2")
    beta, flag = keys.caller_of("Bearer sk-beta"), keys.caller_of("BEARER  sk-flag ")
    assert first is not None and second is not None and beta is not None and flag is not None
    assert first.tenant == second.tenant == "team-a"
    assert first.key_digest != second.key_digest  # same tenant, told apart by key
    assert beta.tenant.startswith("key-") and flag.tenant.startswith("key-")
    assert beta.tenant != flag.tenant
    assert keys.tenants == {"team-a", beta.tenant, flag.tenant}


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Bearer sk-gamma", "Basic sk-alpha-1", "sk-alpha-1"],
)
def test_anything_but_a_known_bearer_key_names_no_caller(authorization: str | None) -> None:
    assert ApiKeys.parse(FILE.splitlines()).caller_of(authorization) is None


def test_without_keys_everyone_is_anonymous() -> None:
    keys = ApiKeys()
    assert not keys.required
    assert keys.caller_of(None) is ANONYMOUS
    assert keys.caller_of("Bearer anything") is ANONYMOUS


@pytest.mark.parametrize(
    ("lines", "flag_keys", "complaint"),
    [
        (["sk-a team extra"], [], "line 1"),
        (["# comment", "sk-a", "sk-a other"], [], "line 3: this API key is listed twice"),
        (["sk-a"], ["sk-a"], "--api-key: this API key is listed twice"),
        ([], [""], "non-empty"),
    ],
)
def test_malformed_entries_are_refused_naming_where(
    lines: list[str], flag_keys: list[str], complaint: str
) -> None:
    with pytest.raises(ValueError, match=complaint):
        ApiKeys.parse(lines, flag_keys)


def test_keys_are_held_only_as_digests() -> None:
    keys = ApiKeys.parse(["sk-secret-value tenant"])
    assert "sk-secret-value" not in repr(vars(keys))
