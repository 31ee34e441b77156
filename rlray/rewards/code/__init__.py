"""Code rewards whose score the code cannot forge: `code_tests`.

Threat model: completions are untrusted, and a policy under RL finds any way to a higher
score; the tests come from the dataset and are trusted. The code runs in an
rlray.sandbox child (its own namespaces and file system, seccomp, limits, no network, not
root: rlray/sandbox/run.py says what holds where) and owns that process: it can read its
frames and every object in it, write to any of its file descriptors, and exit whenever it
likes. So that process decides nothing, and is given nothing that would help it forge:

- The tests run in a second sandboxed process that has none of the code. There every
  name the tests take from the code is a stand-in (test_side.Remote); its calls,
  attributes, items and iteration go to the code's process as plain data (plain.py),
  and the answers come back as plain data: exact builtin types, read without calling a
  method of the code's. An object that is not plain data stays in the code's process,
  as a handle the tests can call into but not inspect: a test that inspects one (an
  `isinstance` on the code's class, an `__eq__` that always holds) fails, logged once.
- The tests' control flow, their variables and their expected values never enter the
  code's process: it sees only requests, one at a time (code_side.py).
- For the stdio format, the code's process gets the input alone; the output is
  compared in this process (stdio.py).
- rlray relays between the two (referee.py), checks every answer as plain data, and
  decides each test's verdict: a test in which the code's process died or ran out of
  time is an error or a timeout, whatever the test made of it.

Why that holds: whatever the code forges (through frames, gc, its output, an early
os._exit) scores what a program answering those values would, and the code could have
answered each honestly. Forging is thus no stronger than special-casing the tests'
inputs, which no reward made of tests can tell from solving. Limits: a test that hands
a function of the code's an expected value (say `assert decode(encode(x)) == x` where
the code defines `encode`) hands it to the code; the dataset's own helpers (HumanEval's
prompt) are the tests' and run in their process, so HumanEval's tests do not. Where the
sandbox has no namespaces, a process that escapes the code's run can reach the tests'
(both are the same user's).
"""

from rlray.rewards.code.reward import code_tests, extract_code

__all__ = ["code_tests", "extract_code"]
