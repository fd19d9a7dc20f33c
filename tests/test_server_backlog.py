"""A crowd of calls that arrives while a role's event loop is busy is answered, never dropped.

gRPC's core holds calls that arrive before the Python server takes them; past its default
limits (1,000 with random early drops, 3,000 hard) it cancels them, and the caller sees
CANCELLED from a server that never saw the call (2,000 streams sent at once to ``make
serve`` lost 25-170 that way). ``proto/server.py:SERVER_OPTIONS`` lifts those limits for every
role. Here a real server from ``start_server`` has its event loop blocked for two seconds while
another process sends 2,500 health checks at once: every one is answered.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from splitserve.proto import server as role_server

CROWD = 2500

CLIENT = """
import json, sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
channel = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(channel).result(timeout=20)
stub = health_pb2_grpc.HealthStub(channel)
print("connected", flush=True)
sys.stdin.readline()  # the server's loop is blocked now
ask = health_pb2.HealthCheckRequest()
calls = [stub.Check.future(ask, timeout=60) for _ in range(int(sys.argv[2]))]
outcomes = {}
for call in calls:
    try:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(call.result().status)
    except grpc.RpcError as error:
        name = error.code().name
    outcomes[name] = outcomes.get(name, 0) + 1
print(json.dumps(outcomes), flush=True)
"""


async def _crowd_while_blocked() -> dict[str, int]:
    server = await role_server.start_server("127.0.0.1", 0, lambda _: (), credential=None, tls=None)
    try:
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, f"127.0.0.1:{server.port}", str(CROWD),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert client.stdin is not None and client.stdout is not None
        assert (await asyncio.wait_for(client.stdout.readline(), 30)).strip() == b"connected"
        client.stdin.write(b"go\n")
        await client.stdin.drain()
        time.sleep(2.0)  # noqa: ASYNC251 - the point: the server's loop takes no calls now
        outcomes = json.loads(await asyncio.wait_for(client.stdout.readline(), 120))
        await client.wait()
        return outcomes
    finally:
        await server.server.stop(None)


@pytest.mark.timeout(180)
def test_a_crowd_arriving_while_the_loop_is_busy_is_answered_not_cancelled() -> None:
    outcomes = asyncio.run(_crowd_while_blocked())
    assert outcomes == {"NOT_SERVING": CROWD}  # the server answers, not yet serving
