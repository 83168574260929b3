"""A persistent session keeps its own streams: a command that redirects or closes the shell's
stdout or stderr (``exec 2>&1``, ``exec >&-``) cannot take the end markers with it, so the next
command answers with its own output and exit code instead of running out its time."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.backends("bwrap", "unshare", "docker")  # one PipeSession for all

REDIRECTS = [
    "exec 2>&1",
    "exec 2>/dev/null",
    "exec 2>&-",
    "exec 1>/dev/null",
    "exec >&-",
    "exec 1>&2",
    "exec 1>/dev/null 2>&1",
]


def test_a_command_that_redirects_the_shells_streams_leaves_the_next_one_intact(
    make_sandbox_for,
):
    sb = make_sandbox_for()
    with sb.session("bash") as shell:
        assert shell.run("cd /tmp && X=kept").ok
        for redirect in REDIRECTS:
            assert shell.run(redirect).exit_code == 0, redirect
            r = shell.run("echo ok; echo $X $PWD; echo oops >&2")
            assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (
                0,
                "ok\nkept /tmp\n",
                "oops\n",
                False,
            ), redirect
        # the redirect lasts for the rest of its own command, as in any shell
        r = shell.run("exec 2>&1; echo to-err >&2")
        assert (r.stdout, r.stderr) == ("to-err\n", "")
        assert shell.restarts == 0, "state must survive: nothing needed a restart"


def test_a_finished_command_whose_stderr_marker_never_comes_restarts_the_interpreter(
    make_sandbox_for,
):
    """Past what a command can do by accident (here a cell points the driver's saved stderr at
    /dev/null): the exit status came, so the command is not reported killed after waiting out
    its time; the interpreter restarts and says so, and the next command runs normally."""
    sb = make_sandbox_for()
    with sb.session("python") as py:
        r = py.run(
            "import os, sys\n"
            "os.dup2(os.open(os.devnull, os.O_WRONLY), sys.modules['__main__'].saved_err)\n"
            "print('done')"
        )
        assert (r.exit_code, r.stdout, r.timed_out) == (0, "done\n", False), r
        assert "session restarted" in r.stderr and py.restarts == 1
        r = py.run("print('ok')")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, "ok\n", "", False)


def test_a_python_cell_that_redirects_fd_1_and_2_leaves_the_next_one_intact(make_sandbox_for):
    sb = make_sandbox_for()
    with sb.session("python") as py:
        assert py.run("import os, sys\nx = 41").ok
        r = py.run("null = os.open(os.devnull, os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 2)")
        assert r.exit_code == 0 and not r.timed_out, r
        r = py.run("print(x + 1); print('oops', file=sys.stderr)")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, "42\n", "oops\n", False)
        assert py.restarts == 0


SHADOWS = [
    "printf() { :; }",
    "exec 1>/dev/null 2>/dev/null; exec() { :; }",
    "eval() { :; }",
    "shopt -s expand_aliases; alias printf=true",
    "exec 1>/dev/null 2>/dev/null; shopt -s expand_aliases; alias exec=true",
    "shopt -s expand_aliases; alias eval=true",
    "shopt -s expand_aliases; alias builtin=true",
]


@pytest.mark.parametrize("shadow", SHADOWS)
def test_a_function_or_alias_named_like_the_sessions_own_commands_leaves_the_next_one_intact(
    make_sandbox_for, shadow
):
    """The session's frame calls bash's builtins themselves, so a command that defines a
    function or alias named ``printf``, ``exec`` or ``eval`` keeps it, and the next command
    still runs and answers with its own output instead of running out its time."""
    sb = make_sandbox_for()
    with sb.session("bash") as shell:
        assert shell.run("X=kept").ok
        assert shell.run(shadow, timeout=20).exit_code == 0, shadow
        r = shell.run("echo ok $X; echo oops >&2", timeout=20)
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, "ok kept\n", "oops\n", False)
        assert shell.restarts == 0


def test_a_python_cell_whose_file_took_fd_1_restarts_rather_than_send_it_to_the_output(
    make_sandbox_for,
):
    """A cell that closes fd 1 and then opens a file has that file at fd 1; pointing fd 1 back
    at the session's output would silently send the file's later writes there. The session
    says so and restarts instead; a cell that only redirected fd 1 (``os.dup2``) keeps its
    state."""
    sb = make_sandbox_for()
    with sb.session("python") as py:
        r = py.run(
            "import os, sys\nfd = os.open(os.devnull, os.O_WRONLY); os.dup2(fd, 1); os.close(fd)"
        )
        assert (r.exit_code, r.timed_out, py.restarts) == (0, False, 0), r
        r = py.run("os.close(1)\nf = open('/tmp/f.txt', 'w')\nprint(f.fileno(), file=sys.stderr)")
        assert r.exit_code == 0 and not r.timed_out, r
        assert "fd 1" in r.stderr and "restarted, state lost" in r.stderr, r.stderr
        assert py.restarts == 1
        r = py.run("print('ok')")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, "ok\n", "", False)


def test_a_python_cell_whose_file_took_fd_2_restarts_too(make_sandbox_for):
    sb = make_sandbox_for()
    with sb.session("python") as py:
        r = py.run("import os\nos.close(2)\ng = open('/tmp/g.txt', 'w')")
        assert r.exit_code == 0 and not r.timed_out, r
        assert "fd 2" in r.stderr and "restarted, state lost" in r.stderr, r.stderr
        r = py.run("print('ok')")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (0, "ok\n", "", False)
