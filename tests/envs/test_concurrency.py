"""64 episodes at once on a thread pool: no deadlock, every episode finishes correctly."""

import time

from composer_jax.envs.environment import EpisodePool, oracle_turns
from composer_jax.envs.tasks.builtin_tasks import builtin_tasks


def test_64_concurrent_episodes():
    tasks = builtin_tasks(64, seed=1)
    start = time.monotonic()
    with EpisodePool(max_workers=16) as pool:
        episodes = [future.result(timeout=120) for future in [pool.start(t) for t in tasks]]
        scripts = [oracle_turns(task) for task in tasks]
        results = [None] * len(tasks)
        for turn_index in range(2):
            futures = [pool.submit(ep, script[turn_index]) for ep, script in zip(episodes, scripts)]
            results = [future.result(timeout=120) for future in futures]
    elapsed = time.monotonic() - start
    for episode in episodes:
        episode.close()
    print(f"64 concurrent episodes: {len(tasks) / elapsed:.1f} episodes/s")
    assert all(r.done and r.reward == 1.0 for r in results)
