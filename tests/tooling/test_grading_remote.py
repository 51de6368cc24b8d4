"""What crosses between the check's process and the student's (minillm.course.remote).

The student's side is a forked child serving the functions below; the check's side sees
only what the protocol rebuilds. Each case is something a student's code could return to
make a check pass that should not.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal

import pytest
import torch

from minillm.course import remote


class Anything(int):
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return True

    __hash__ = int.__hash__


class LyingTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.equal:
            return True
        return super().__torch_function__(func, types, args, kwargs or {})


class Counter:
    def __init__(self):
        self.n = 0

    def bump(self, by):
        self.n += by
        return self.n

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


class Mine(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int


def fill(out, value):
    """A kernel-like function: writes its output in place, and one past its end."""
    out.fill_(value)
    base = torch.empty(0, dtype=out.dtype).set_(out.untyped_storage())
    base[out.storage_offset() + out.numel()] = -1.0
    return None


def first(points):
    return points[0]


def append_to(items, value):
    items.append(value)


def call_back(function, value):
    return function(value) + 1


def raises(kind):
    if kind == "value":
        raise ValueError("bad input")
    if kind == "own":
        raise Mine("mine")
    if kind == "exit":
        raise SystemExit(0)
    os.kill(os.getpid(), signal.SIGKILL)


def reach_in(target, op, *args):
    """What a student's code can ask of a check's object, bypassing `Remote`'s own rules."""
    return remote._req(target, op, *args)


STUDENT = {
    "reach_in": reach_in,
    "anything": lambda: Anything(0),
    "lying_tensor": lambda: torch.zeros(3).as_subclass(LyingTensor),
    "counter": Counter,
    "fill": fill,
    "first": first,
    "append_to": append_to,
    "call_back": call_back,
    "raises": raises,
    "nan": lambda: [math.nan, (1, "a"), {2: b"x"}, {3}],
}


@pytest.fixture
def student():
    """The check's end of a connection to a forked process that serves STUDENT."""
    ours, theirs = remote.pair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            # as a student's code is: defined in __main__, which the check's side never
            # looks up by name
            for value in (*STUDENT.values(), Anything, LyingTensor, Counter, Mine):
                value.__module__ = "__main__"
            conn = remote.Connection(theirs, trusted=False)
            conn.exported[0] = lambda: STUDENT
            conn.serve_forever()
        finally:
            os._exit(0)
    theirs.close()
    conn = remote.Connection(ours, trusted=True)
    yield conn.request("call", 0)
    ours.close()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_an_int_that_equals_everything_arrives_as_its_value(student):
    got = student["anything"]()
    assert type(got) is int and got == 0 and got != 1


def test_a_tensor_subclass_arrives_as_a_plain_tensor(student):
    got = student["lying_tensor"]()
    assert type(got) is torch.Tensor
    assert not torch.equal(got, torch.ones(3))


def test_a_students_object_stays_in_its_process_and_decides_no_comparison(student):
    counter = student["counter"]()
    assert isinstance(counter, remote.Remote)
    assert counter.bump(2) == 2 and counter.bump(3) == 5
    assert counter != 5 and not (counter == Counter())
    assert counter == counter


def test_arguments_written_in_place_come_back(student):
    buffer = torch.full((6,), 7.0)
    out = buffer[1:4]
    student["fill"](out, 2.0)
    assert buffer.tolist() == [7.0, 2.0, 2.0, 2.0, -1.0, 7.0]  # the write past the end shows
    items = [1]
    student["append_to"](items, 2)
    assert items == [1, 2]


def test_a_value_sent_back_is_the_senders_object(student):
    points = [Point(1, 2), Point(3, 4)]
    assert student["first"](points) is points[0]


def test_the_students_code_can_call_the_checks_functions(student):
    assert student["call_back"](lambda v: v * 10, 4) == 41


def test_plain_values_keep_their_types(student):
    got = student["nan"]()
    assert math.isnan(got[0]) and got[1:] == [(1, "a"), {2: b"x"}, {3}]


def test_exceptions_cross_as_their_builtin_kind(student):
    with pytest.raises(ValueError, match="bad input"):
        student["raises"]("value")
    with pytest.raises(ValueError) as caught:
        student["raises"]("own")
    assert type(caught.value) is ValueError  # the student's class stays in its process
    with pytest.raises(RuntimeError, match="SystemExit"):  # it fails the check, not ends it
        student["raises"]("exit")


def test_a_student_process_that_dies_ends_the_call(student):
    with pytest.raises(remote.PeerGone):
        student["raises"]("die")


def test_the_checks_objects_show_the_student_no_private_attribute(student):
    """A lent function's `__globals__` is the check's namespace (its expected values, its
    `torch`), a bound method's `__self__` its instrument; a private attribute of a lent
    clock its log. The student's code gets none of them, and sets none."""

    class Meter:
        reading = 3

        def read(self):
            return self.reading

    meter = Meter()
    asks = [
        ("getattr", "__globals__"),
        ("getattr", "__code__"),
        ("getattr", "__self__"),
        ("getattr", "_log"),
        ("setattr", "__code__", None),
        ("setattr", "_log", []),
        ("delattr", "_log"),
        ("getattr", 3),
    ]
    for ask in asks:
        for target in (meter.read, meter):
            with pytest.raises(AttributeError, match="public attributes only"):
                student["reach_in"](target, *ask)
    assert student["reach_in"](meter, "getattr", "reading") == 3  # public ones are answered
    student["reach_in"](meter, "setattr", "reading", 4)
    assert meter.read() == 4
