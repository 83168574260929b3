"""What the ``local`` backend protects against, how, and the tests that attack each property.

``LocalSandbox.PROTECTS`` and ``NOT_PROTECTED`` (``envhub sandbox info`` prints them); the
backend's module docstring (``local.py``) says the same in prose and names the same tests, which
``tests/sandboxes/test_protections.py`` checks.
"""

from __future__ import annotations

from sandboxes.base import Protection

__all__ = ["LOCAL_NOT_PROTECTED", "LOCAL_PROTECTS"]

LOCAL_PROTECTS = tuple(
    Protection(name, how, tuple(f"tests/sandboxes/{t}" for t in tests))
    for name, how, tests in (
        (
            "infinite loops",
            "wall-clock deadline, then SIGKILL of the process tree; RLIMIT_CPU",
            (
                "test_adversarial.py::test_infinite_loop_is_killed_at_the_wall_time_limit",
                "test_adversarial.py::test_cpu_time_limit_kills_a_busy_program",
            ),
        ),
        (
            "fork bombs",
            "cgroup pids.max + RLIMIT_NPROC on a private uid",
            ("test_adversarial.py::test_fork_bomb_is_capped_and_returns_in_bounded_time",),
        ),
        (
            "memory bombs",
            "cgroup memory limit (OOM reported), else RLIMIT_AS",
            ("test_adversarial.py::test_memory_bomb_is_oom_killed_and_reported",),
        ),
        (
            "disk fill",
            "scratch, /tmp, /dev/shm: tmpfs capped at disk_mb; /dev read-only; RLIMIT_FSIZE",
            (
                "test_adversarial.py::test_disk_fill_in_scratch_and_tmp_stops_at_the_cap",
                "test_reuse.py::test_every_writable_tmpfs_is_capped_at_disk_mb",
                "test_reuse.py::test_posix_message_queues_hold_at_most_disk_mb",
                "test_reuse.py::test_sysv_shared_memory_is_capped_at_disk_mb",
            ),
        ),
        (
            "output floods",
            "max_output_bytes per stream, then the run is killed",
            ("test_adversarial.py::test_output_flood_is_truncated_and_the_run_stopped",),
        ),
        (
            "network egress",
            "own network namespace with only a loopback",
            ("test_adversarial.py::test_network_egress_to_loopback_and_outside_fails",),
        ),
        (
            "reading host files",
            "only /usr, public /etc files and scratch are visible",
            ("test_adversarial.py::test_host_files_are_not_readable",),
        ),
        (
            "host paths",
            "scratch bound from an fd, /etc/passwd from a memfd",
            ("test_adversarial.py::test_no_host_path_shows_in_mounts_or_process_lines",),
        ),
        (
            "writing outside scratch",
            "read-only mounts, unprivileged uid, no capabilities",
            ("test_adversarial.py::test_writes_outside_scratch_fail_and_tmp_is_private",),
        ),
        (
            "orphans",
            "PID namespace per run; warm: cgroup sweep after every run",
            (
                "test_adversarial.py::test_background_processes_do_not_survive_a_timeout",
                "test_reuse.py::test_a_process_left_behind_is_dead_when_the_run_returns",
                "test_zygote.py::test_a_background_process_of_a_run_is_gone_before_the_next",
            ),
        ),
        (
            "state from one run in the next",
            "warm: every run a fresh fork of a zygote that never runs a run's code",
            (
                "test_zygote.py::test_modules_globals_handlers_and_threads_of_a_run_are_not_in_the_next",
                "test_zygote.py::test_unseeded_random_numbers_differ_between_runs",
                "test_zygote.py::test_files_a_run_leaves_do_not_reach_the_next_user",
            ),
        ),
        (
            "a broken or lying zygote",
            "warm: strict fixed-size replies, host-side deadlines; a restart on any doubt",
            (
                "test_zygote.py::test_signals_a_run_sends_the_zygote_do_not_stop_it",
                "test_zygote.py::test_a_run_that_stops_or_kills_the_spawner_costs_a_restart",
                "test_zygote.py::test_a_zygote_killed_mid_run_costs_a_restart",
                "test_zygote.py::test_a_run_that_exhausts_the_sandbox_memory_costs_a_restart",
                "test_zygote.py::test_a_zygote_that_lies_costs_a_restart_and_never_hangs_the_host",
            ),
        ),
        (
            "signals",
            "PID namespace: host processes are invisible",
            ("test_adversarial.py::test_signals_cannot_reach_the_host_and_cannot_stop_the_kill",),
        ),
        (
            "tampering with what outlives a run",
            (
                "the zygote is PID 1 and non-dumpable; seccomp denies ptrace; "
                "reset() verifies it or starts a fresh one"
            ),
            (
                "test_adversarial.py::test_processes_that_outlive_a_run_cannot_be_attached_or_rewritten",
                "test_adversarial.py::test_a_run_that_stops_or_kills_everything_it_sees_does_not_break_the_next",
                "test_adversarial.py::test_reset_replaces_an_executor_it_cannot_verify",
                "test_adversarial.py::test_a_run_cannot_lower_the_limits_or_cpu_share_of_the_next_user",
                "test_zygote.py::test_reset_replaces_a_spawner_it_cannot_verify",
            ),
        ),
        (
            "kernel objects across reset",
            (
                "private /dev/mqueue, /dev/shm and /tmp emptied; SysV IPC denied; "
                "fresh namespaces when a socket is left"
            ),
            (
                "test_reuse.py::test_ipc_objects_do_not_reach_the_next_user",
                "test_reuse.py::test_files_in_dev_shm_and_tmp_do_not_reach_the_next_user",
                "test_reuse_unix_sockets.py::test_unix_sockets_held_only_by_the_kernel_do_not_reach_the_next_user",
            ),
        ),
        (
            "keyrings",
            "seccomp denies the keyring syscalls; unshare mode joins a fresh session keyring",
            (
                "test_adversarial.py::test_the_host_session_keyring_is_out_of_reach",
                "test_reuse.py::test_keys_do_not_reach_the_next_user_or_a_later_sandbox",
                "test_reuse.py::test_keyring_syscalls_are_denied",
            ),
        ),
        (
            "env-var leakage",
            "BASE_ENV plus what the caller passes",
            ("test_adversarial.py::test_host_environment_does_not_leak",),
        ),
        (
            "host file tricks",
            "O_NOFOLLOW *at() access; bad paths raise SandboxFileError",
            (
                "test_adversarial.py::test_planted_symlinks_do_not_expose_host_files",
                "test_reuse.py::test_an_over_long_path_raises_sandbox_file_error",
            ),
        ),
    )
)
LOCAL_NOT_PROTECTED = (
    (
        "kernel exploits through syscalls the seccomp filter allows "
        "(a deny list, like Docker's default)"
    ),
    ("CPU starvation of the host beyond one run's CPU limit (no cpu cgroup quota); side channels"),
    (
        "with Limits(network=True): host loopback services and abstract UNIX sockets "
        "(host network namespace)"
    ),
    (
        "a one-shot run can write its own bubblewrap init (PID 1) via /proc/1/mem; "
        "it dies with the run"
    ),
    (
        "without root: no private uid, cgroups, tmpfs scratch or warm executor "
        "(see the module docstring)"
    ),
    (
        "warm: Python runs of one zygote share its str hash seed and address-space layout, "
        "and see its pre-imported modules"
    ),
    (
        "warm: memory a run left in flight in a UNIX socket cycle stays charged to the sandbox "
        "until the kernel's unix GC frees it (scheduled as the old namespaces close; not awaited)"
    ),
)
