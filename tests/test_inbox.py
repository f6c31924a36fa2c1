"""The inbox through which other threads hand a device's worker its engine work (hydra_torch.run.inbox)."""
import threading

from hydra_torch.run.inbox import Inbox


def test_a_job_run_where_it_is_posted_may_post_the_next_to_the_same_closed_inbox():
    # A task leaving the engines runs its rounds as jobs that post the next round; once the worker has ended, each
    # runs on the posting thread, which already drives the engine (the lock it holds was not re-entrant: a hang).
    inbox, ran = Inbox(), []
    inbox.close()

    def first():
        ran.append("first")
        inbox.run_or_post(lambda: ran.append("second"))
    thread = threading.Thread(target=lambda: inbox.run_or_post(first), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the second job waited for the lock the first one's thread holds"
    assert ran == ["first", "second"]


def test_jobs_posted_while_the_worker_lives_run_when_it_drains_or_closes():
    inbox, ran = Inbox(), []
    assert inbox.post(lambda: ran.append(1))
    inbox.run_or_post(lambda: ran.append(2))
    assert ran == []
    inbox.drain()
    assert ran == [1, 2]
    inbox.post(lambda: ran.append(3))
    inbox.close()
    assert ran == [1, 2, 3] and inbox.closed
    assert not inbox.post(lambda: ran.append(4))
    inbox.run_or_post(lambda: ran.append(5))
    assert ran == [1, 2, 3, 5]


def test_once_closed_one_posting_thread_at_a_time_runs_its_job():
    inbox, inside, overlaps = Inbox(), [0], []
    inbox.close()
    lock = threading.Lock()
    release = threading.Event()

    def job():
        with lock:
            inside[0] += 1
            overlaps.append(inside[0])
        release.wait(0.05)
        with lock:
            inside[0] -= 1
    threads = [threading.Thread(target=lambda: inbox.run_or_post(job)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlaps == [1, 1, 1, 1]
