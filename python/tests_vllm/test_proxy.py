"""kvferry.vllm_proxy: what it hands each engine, and the prefills it refuses at start."""

import subprocess
import sys

import pytest

from kvferry.vllm_proxy import PUSH_BIT, Router, parse_prefill, push_params


def test_a_prefill_is_a_url_with_its_listeners_and_stages():
    assert parse_prefill("http://p:8100") == ("http://p:8100", None, 1)
    assert parse_prefill("http://p:8100=10.0.0.1:7000") == ("http://p:8100", ["10.0.0.1:7000"], 1)
    assert parse_prefill("http://p:8100=10.0.0.1:7000,10.0.0.1:7001") == (
        "http://p:8100", ["10.0.0.1:7000", "10.0.0.1:7001"], 1)
    assert parse_prefill("http://p:8100=pp=2, 10.0.0.1:1,10.0.0.2:1,[::1]:1,[::1]:2") == (
        "http://p:8100", ["10.0.0.1:1", "10.0.0.2:1", "[::1]:1", "[::1]:2"], 2)


@pytest.mark.parametrize("spec", ["http://p=pp=2,1.1.1.1:1,1.1.1.1:2,1.1.1.1:3", "http://p=pp=0,1.1.1.1:1",
                                  "http://p=pp=x,1.1.1.1:1", "http://p=pp=2", "http://p=",
                                  "http://p=prefill-host:7000", "http://p=1.1.1.1:0", "http://p=1.1.1.1"])
def test_a_prefill_whose_listeners_are_not_addresses_in_equal_stages_is_refused(spec):
    with pytest.raises(ValueError, match="--prefill"):
        parse_prefill(spec)


def test_push_rooms_name_a_pipeline_parallel_prefills_stages_to_the_decode():
    room = PUSH_BIT | 7
    to_prefill, to_decode = push_params(room, ["10.0.0.1:1", "10.0.0.2:1"], 2)
    assert to_prefill == {"do_remote_decode": True, "kvferry_push": True, "kvferry_room": room}
    assert to_decode == {"do_remote_prefill": True, "kvferry_push": True, "kvferry_room": room,
                         "kvferry_addrs": ["10.0.0.1:1", "10.0.0.2:1"], "kvferry_pp": 2}
    # One stage: the decode's params say nothing of stages (kvferry_pp defaults to 1).
    assert "kvferry_pp" not in push_params(room, ["10.0.0.1:1"], 1)[1]


def test_push_mode_without_a_prefills_listeners_is_refused():
    with pytest.raises(ValueError, match="--push needs"):
        Router(["http://p:8100"], ["http://d:8200"], 10, push=True)


def test_the_proxy_refuses_a_bad_prefill_at_start_naming_it():
    out = subprocess.run([sys.executable, "-m", "kvferry.vllm_proxy", "--push", "--prefill", "http://p=pp=2,1.1.1.1:1",
                          "--decode", "http://d"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "do not split into 2 equal stages" in out.stderr
