"""A pickle's object graph bounded before anything unpickles it.

Pickle's memo and DUP let a few bytes build a graph whose tree is exponential (`)` then
`2\\x86` forty times: a tuple of 2**40 leaves in 81 bytes), and a chain of one-item tuples
nests a million deep in a megabyte. Hashing such a tuple as a dict key while unpickling
hangs or overflows the C stack; `str()`, `==` or any walk of it afterwards expands it.
`problem(raw)` runs the pickle's opcodes over a stack of (tree size, depth) numbers
instead of objects, in one pass, nothing unpickled or decoded, and says what is wrong:
the objects that opcodes put into containers, arguments or state add up, each at its tree
size, to more than a fixed multiple of the pickle's bytes (so any walk of what it
unpickles is linear in its size); objects nest deeper than any checkpoint's; a memo index
past the pickle's length (the C unpickler grows its memo array to the index, zero-filled);
or the opcodes do not form a pickle. (An integer too long for `str()`, over 4,300 digits,
is a value: each reader checks its values before a message shows them, with
`errors.shown`.)
"""
from __future__ import annotations

MAX_DEPTH = 100  # a DCP .metadata nests 11 to 14 deep, a state dict's pickle fewer
WORK_PER_BYTE = 32  # real pickles (DCP and Megatron .metadata, state dicts) place about 3 per byte
WORK_FLOOR = 1 << 20

# Stack effects: push one object; push what the memo holds; memoize the top (MEMOIZE, at
# the next index; PUT at its argument); MARK; build an object from k items (or the items
# above the mark), add them to the object below (APPEND, SETITEM, BUILD); DUP, POP,
# POP_MARK; nothing (PROTO, FRAME); STOP.
(_PUSH, _GET, _MEMOIZE, _PUT, _MARK, _DUP, _POP, _POP_MARK, _NOTHING, _STOP, _BUILD, _BUILD_MARK, _ADD,
 _ADD_MARK) = range(14)
# Argument layouts: a fixed width (0: none), a text line, two lines, a 1/4/8-byte length.
_LINE, _LINES, _LEN1, _LEN4, _LEN4_SIGNED, _LEN8 = -1, -2, -3, -4, -5, -6
_OPS = {  # opcode: (stack effect, items it takes, argument layout)
    **{op: (_PUSH, 0, 0) for op in b"\x97N\x88\x89])}\x8f"},
    **{op: (_PUSH, 0, n) for op, n in zip(b"JKMG\x82\x83\x84", (4, 1, 2, 8, 1, 2, 4))},
    **{op: (_PUSH, 0, _LINE) for op in b"ILSVFP"},
    **{op: (_PUSH, 0, _LEN1) for op in b"\x8aUC\x8c"},
    **{op: (_PUSH, 0, _LEN4) for op in b"BX"},
    **{op: (_PUSH, 0, _LEN4_SIGNED) for op in b"\x8bT"},
    **{op: (_PUSH, 0, _LEN8) for op in b"\x8e\x96\x8d"},
    ord("c"): (_PUSH, 0, _LINES),
    ord("g"): (_GET, 0, _LINE), ord("h"): (_GET, 0, 1), ord("j"): (_GET, 0, 4),
    0x94: (_MEMOIZE, 0, 0),
    ord("p"): (_PUT, 0, _LINE), ord("q"): (_PUT, 0, 1), ord("r"): (_PUT, 0, 4),
    ord("("): (_MARK, 0, 0),
    **{op: (_BUILD, k, 0) for op, k in zip(b"\x85\x86\x87\x93R\x81\x92Q", (1, 2, 3, 2, 2, 2, 3, 1))},
    **{op: (_BUILD_MARK, 0, 0) for op in b"ltd\x91o"},
    ord("i"): (_BUILD_MARK, 0, _LINES),
    **{op: (_ADD, k, 0) for op, k in zip(b"asb\x98", (1, 2, 1, 0))},
    **{op: (_ADD_MARK, 0, 0) for op in b"eu\x90"},
    ord("2"): (_DUP, 0, 0), ord("0"): (_POP, 1, 0), ord("1"): (_POP_MARK, 0, 0),
    0x80: (_NOTHING, 0, 1), 0x95: (_NOTHING, 0, 8),
    ord("."): (_STOP, 1, 0),
}
_TABLE = [_OPS.get(op) for op in range(256)]
# The hot path: leaves by their whole length, opcode and argument (-1: a 1-byte length,
# then the data). Other leaves use _TABLE.
_LEAF_STEP = [0] * 256
for _op, (_effect, _, _layout) in _OPS.items():
    if _effect == _PUSH and _layout >= 0:
        _LEAF_STEP[_op] = 1 + _layout
    elif _effect == _PUSH and _layout == _LEN1:
        _LEAF_STEP[_op] = -1
_LEAF = 1 << 8  # an object on the stack: its tree size << 8 | its depth


class _Malformed(Exception):
    pass


def problem(raw: bytes) -> str | None:
    """Why unpickling `raw` or walking what it gives could run away, or None."""
    try:
        return _Scan(raw, WORK_PER_BYTE * len(raw) + WORK_FLOOR).run()
    except _Malformed as exc:
        return f"{exc}: not a pickle"
    except (IndexError, KeyError, ValueError, TypeError):  # ran out of bytes or stack, a memo index never set
        return "its opcodes do not form a pickle"


_CLEAN = "the pickle ends (STOP) within its bounds"  # returned by identity: the scan is over, nothing found


class _Scan:
    """One pickle's scan: its stack (each object as its tree size << 8 | its depth), the
    stack positions of its open MARKs, its memo, and the work counted so far. `run` keeps
    the common opcodes in its loop; the others are `_build` (an opcode that makes one object
    of those above it) and `_other`."""

    def __init__(self, raw: bytes, limit: int):
        self.raw, self.limit, self.end = raw, limit, len(raw)
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: dict[int, int] = {}
        self.work = 0
        self.fence = 0  # the innermost open MARK: nothing below it may be taken

    def run(self) -> str | None:
        raw, stack, memo = self.raw, self.stack, self.memo
        push, pos = stack.append, 0
        while True:
            op = raw[pos]
            step = _LEAF_STEP[op]
            if step:  # the common opcodes first: leaves (constants, small ints, short strings) and the memo
                pos += step if step > 0 else 2 + raw[pos + 1]
                push(_LEAF)
                continue
            if op == 0x94:  # MEMOIZE
                if len(stack) == self.fence:
                    raise _Malformed("a memo entry of nothing")
                memo[len(memo)] = stack[-1]
                pos += 1
                continue
            if op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                width = 1 if op == 0x68 else 4
                push(memo[int.from_bytes(raw[pos + 1:pos + 1 + width], "little")])
                pos += 1 + width
                continue
            effect, k, layout = _TABLE[op]
            start = pos + 1
            pos = self._past_argument(start, layout)
            found = self._build(effect, k) if effect >= _BUILD else self._other(effect, start, pos, layout)
            if found is not None:
                return None if found is _CLEAN else found

    def _past_argument(self, pos: int, layout: int) -> int:
        if layout > 0:
            pos += layout
        elif layout == _LINE:
            pos = self.raw.index(b"\n", pos) + 1
        elif layout:
            pos = _skip(self.raw, pos, layout)
        if pos > self.end:
            raise _Malformed("an argument runs past the end")
        return pos

    def _build(self, effect: int, k: int) -> str | None:
        """_BUILD, _BUILD_MARK, _ADD, _ADD_MARK: the objects above the mark (or the top `k`)
        become one (added into the object below them for _ADD*); a problem, or None."""
        stack = self.stack
        if effect == _BUILD_MARK or effect == _ADD_MARK:
            base = self.marks.pop()
            self.fence = self.marks[-1] if self.marks else 0
        else:
            base = len(stack) - k
            if base < self.fence:
                raise _Malformed("an opcode takes more objects than there are")
        size = depth = 0
        for item in stack[base:]:
            size += item >> 8
            if item & 255 >= depth:
                depth = (item & 255) + 1
        del stack[base:]
        self.work += size
        if effect >= _ADD:  # into the object below them
            if len(stack) == self.fence:
                raise _Malformed("an opcode adds to an object that is not there")
            below = stack.pop()
            size, depth = size + (below >> 8) - 1, max(depth, below & 255)
        if self.work > self.limit:
            return (f"its objects expand to more than {self.limit:,} nodes in {self.end:,} bytes (shared references "
                    "nested to multiply)")
        if depth > MAX_DEPTH:
            return f"it nests objects more than {MAX_DEPTH} deep"
        stack.append((size + 1) << 8 | depth)
        return None

    def _other(self, effect: int, start: int, pos: int, layout: int) -> str | None:
        """The rarer opcodes: a problem, _CLEAN at STOP, or None to go on."""
        stack, memo = self.stack, self.memo
        if effect == _PUSH:
            stack.append(_LEAF)
        elif effect == _GET:
            stack.append(memo[_argument(self.raw, start, pos, layout)])
        elif effect == _PUT:
            if len(stack) == self.fence:
                raise _Malformed("a memo entry of nothing")
            index = _argument(self.raw, start, pos, layout)
            if index > self.end:  # the unpickler would grow its memo array to it, zeroed: gigabytes from 5 bytes
                return (f"it puts an object at memo index {index}, more objects than a pickle of {self.end:,} bytes "
                        "holds (the unpickler would allocate every index below it)")
            memo[index] = stack[-1]
        elif effect == _MARK:
            self.fence = len(stack)
            self.marks.append(self.fence)
        elif effect == _POP_MARK or (effect == _POP and self.marks and len(stack) == self.fence):  # POP takes a mark
            del stack[self.marks.pop():]
            self.fence = self.marks[-1] if self.marks else 0
        elif effect == _NOTHING:  # PROTO, FRAME
            pass
        elif len(stack) == self.fence:  # DUP, POP, STOP need an object
            raise _Malformed("an opcode needs an object where there is none")
        elif effect == _DUP:
            stack.append(stack[-1])
        elif effect == _POP:
            stack.pop()
        elif effect == _STOP:
            return _CLEAN
        return None


def _skip(raw: bytes, pos: int, layout: int) -> int:
    """The end of an argument of the rarer layouts."""
    if layout == _LINES:
        return raw.index(b"\n", raw.index(b"\n", pos) + 1) + 1
    if layout in (_LEN4, _LEN4_SIGNED):
        return pos + 4 + max(0, int.from_bytes(raw[pos:pos + 4], "little", signed=layout == _LEN4_SIGNED))
    if layout == _LEN1:
        return pos + 1 + raw[pos]
    return pos + 8 + int.from_bytes(raw[pos:pos + 8], "little")


def _argument(raw: bytes, start: int, end: int, layout: int) -> int:
    """A memo index; a text one only in plain digits (as the unpickler reads them, no
    sign, space or underscore it could read otherwise)."""
    if layout != _LINE:
        return int.from_bytes(raw[start:end], "little")
    if not raw[start:end - 1].isdigit():
        raise _Malformed("a memo index that is not a number")
    return int(raw[start:end - 1])
