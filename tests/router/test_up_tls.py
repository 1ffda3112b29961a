"""`shardline up` with TLS everywhere, the internal token, an API key and --metrics-auth.

Certificates come from a CA the test makes. The official `openai` client streams over HTTPS and
a gRPC client that trusts the CA streams from the router; a worker called without the internal
token answers UNAUTHENTICATED (with it, over TLS, Stats answers); the router's /metrics wants the
API key and still re-exports telemetry's /metrics, which is HTTPS behind the token.
"""

from __future__ import annotations

import re
import ssl

import grpc
import httpx
import openai
import pytest

from services.cli.client import stream_generate
from services.common.proto import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from services.common.transport_security import TOKEN_METADATA_KEY, TransportSecurity, open_channel
from tests.certs import make_pki
from tests.router.processes import running_up
from tests.router.test_up import up_command

pytestmark = pytest.mark.slow

API_KEY = "sk-test-tls"
TOKEN = "internal-token-for-the-test"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("up-tls")
    pki = make_pki(tmp / "pki")
    argv, env, ports = up_command(tmp, "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
                                  "--tls-ca", str(pki.ca), "--api-key", API_KEY, "--metrics-auth")
    env["SHARDLINE_INTERNAL_TOKEN"] = TOKEN  # the environment, as a secret should travel
    with running_up(argv, env, tmp / "up.out") as out:
        yield pki, ports, out
    assert TOKEN not in " ".join(argv)


def test_openai_client_streams_over_https(stack) -> None:
    pki, ports, out = stack
    assert f"https://127.0.0.1:{ports['http']}/v1" in out.read_text()
    verify = ssl.create_default_context(cafile=str(pki.ca))
    with httpx.Client(verify=verify) as http:
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{ports['http']}/v1", api_key=API_KEY,
                               http_client=http, max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8, temperature=0,
                                           stream=True)
        pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert len(pieces) >= 1 and all(isinstance(p, str) for p in pieces)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"https://127.0.0.1:{ports['http']}/v1", api_key="wrong", http_client=http,
                          max_retries=0).models.list()
    with pytest.raises(httpx.TransportError):  # plaintext HTTP to the TLS port
        httpx.get(f"http://127.0.0.1:{ports['http']}/v1/models", timeout=10)
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
        httpx.get(f"https://127.0.0.1:{ports['http']}/v1/models", timeout=10)


def test_grpc_client_with_the_ca_streams(stack) -> None:
    pki, ports, _out = stack
    request = router_pb2.RouterGenerateRequest(text="hello", sampling=common_pb2.SamplingParameters(
        temperature=0.0, max_tokens=8))
    result = stream_generate(f"127.0.0.1:{ports['router']}", request, api_key=API_KEY,
                             security=TransportSecurity(ca_file=str(pki.ca)))
    assert result.completion_tokens == 8 and len(result.token_ids) == 8
    with pytest.raises(grpc.RpcError) as plaintext:
        stream_generate(f"127.0.0.1:{ports['router']}", request, api_key=API_KEY, security=TransportSecurity(),
                        timeout_s=10)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE


def test_worker_without_the_internal_token_is_unauthenticated(stack) -> None:
    pki, ports, out = stack
    # the fleet's group, as `up` reported it when it went into rotation
    worker = re.search(r"\n  tiny-llama-[0-9a-f]{6} (127\.0\.0\.1:\d+) +SERVING", out.read_text()).group(1)
    with open_channel(worker, TransportSecurity(ca_file=str(pki.ca))) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Stats(worker_pb2.StatsRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused_stream:
            list(stub.Generate(worker_pb2.GenerateRequest(), timeout=10))
        assert refused_stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stats = stub.Stats(worker_pb2.StatsRequest(), timeout=10, metadata=((TOKEN_METADATA_KEY, TOKEN),))
        assert stats.replica_group_id


def test_metrics_need_their_credentials(stack) -> None:
    pki, ports, _out = stack
    verify = ssl.create_default_context(cafile=str(pki.ca))
    url = f"https://127.0.0.1:{ports['http']}/metrics"
    assert httpx.get(url, verify=verify, timeout=10).status_code == 401
    scraped = httpx.get(url, verify=verify, timeout=30, headers={"authorization": f"Bearer {API_KEY}"})
    assert scraped.status_code == 200
    # telemetry's own /metrics is HTTPS behind the internal token, and the router still reads it
    upstream = [line for line in scraped.text.splitlines() if line.startswith("shardline_metrics_upstream_up{")]
    assert upstream and all(line.endswith(" 1.0") for line in upstream), upstream
    telemetry_url = upstream[0].split('upstream="', 1)[1].split('"', 1)[0]
    assert telemetry_url.startswith("https://")
    assert httpx.get(telemetry_url, verify=verify, timeout=10).status_code == 401
