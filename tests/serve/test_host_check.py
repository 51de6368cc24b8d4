"""The Host check against DNS rebinding: a page on attacker.example that makes its name
resolve to 127.0.0.1 sends `Host: attacker.example`, and is refused before anything is read;
clients that name the server by localhost, an IP address or an allowed name are served."""

from __future__ import annotations

import httpx
import pytest

from minillm.serve import run_server
from minillm.serve.api_server import HostCheckMiddleware, check_allowed_hosts, host_name


def status(server, host: str, path: str = "/v1/models") -> httpx.Response:
    return httpx.get(server.url + path, headers={"host": host}, timeout=60)


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("LocalHost", "localhost"),
        ("[::1]:8000", "::1"),
        ("[::1]", "::1"),
        ("127.0.0.1:80", "127.0.0.1"),
        ("example.com.", "example.com"),
        ("Example.COM:443", "example.com"),
        ("::1", "::1"),  # an IPv6 address without brackets or port
    ],
)
def test_host_name_takes_the_name_out_of_a_host_header(header, name):
    assert host_name(header) == name


def test_the_default_list_is_localhost_names_and_ip_addresses():
    check = HostCheckMiddleware(app=None, allowed_hosts=[])
    accepted = ["localhost", "localhost:1234", "127.0.0.1:8000", "[::1]:8000", "10.0.0.7:8000"]
    refused = ["attacker.example", "localhost.attacker.example", "127.0.0.1.nip.io", "x"]
    assert all(check.accepts(host) for host in accepted)
    assert not any(check.accepts(host) for host in refused)
    named = HostCheckMiddleware(app=None, allowed_hosts=["Box.Lan"])
    assert named.accepts("box.lan:8000") and not named.accepts("other.lan")


@pytest.fixture(scope="module")
def server(llm):
    with run_server(llm, port=0, allowed_hosts=["gpu-box.lan"]) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/health"])
def test_a_foreign_host_is_a_400_in_openai_json_on_every_route(server, path):
    response = status(server, "attacker.example:8000", path)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_host" and error["param"] == "Host"
    assert "--allowed-hosts attacker.example" in error["message"]


def test_a_post_from_a_foreign_host_never_reaches_the_engine(server):
    before = server.engine.scheduler.num_steps
    response = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 50},
        headers={"host": "attacker.example"},
        timeout=60,
    )
    assert response.status_code == 400
    assert server.engine.scheduler.num_steps == before


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "gpu-box.lan:8000", "GPU-BOX.LAN"])
def test_local_names_addresses_and_allowed_names_are_served(server, host):
    assert status(server, host).status_code == 200


def test_the_bound_name_is_allowed_and_a_star_turns_the_check_off(reference_llm):
    with run_server(reference_llm, port=0, host="localhost") as server:
        assert status(server, "localhost").status_code == 200
        assert status(server, "attacker.example").status_code == 400
    with run_server(reference_llm, port=0, allowed_hosts=["*"]) as server:
        assert status(server, "attacker.example").status_code == 200


@pytest.mark.parametrize("bad", [[""], ["a/b"], ["user@host"], [3], ["two words"]])
def test_bad_allowed_hosts_are_refused_where_they_enter(bad):
    with pytest.raises(ValueError, match="allowed_hosts holds host names"):
        check_allowed_hosts(bad)


def test_the_command_line_passes_allowed_hosts():
    from minillm.cli.main import build_parser
    from minillm.cli.serve import server_options

    args = build_parser("serve").parse_args(["serve", "--allowed-hosts", "a.lan", "b.lan"])
    assert server_options(args) == {"allowed_hosts": ["a.lan", "b.lan"]}
