"""SamplerGroup: requests balanced over samplers and kept on theirs, ids mapped both ways, the
oldest version, summed stats, and a lost sampler freeing every other sampler's requests."""

import pytest

from composer_jax.actor.ray_backend import SamplerLostError
from composer_jax.actor.sampler import Sampler
from composer_jax.actor.sampler_group import SamplerGroup
from composer_jax.infer import Completion


class FakeSampler(Sampler):
    """Local ids from 0; `finish` marks requests whose next poll returns a turn."""

    def __init__(self, version):
        self.num_slots, self.max_len = 2, 100
        self._version, self.next_id = version, 0
        self.live, self.finished, self.calls, self.lost = set(), [], [], False

    @property
    def version(self):
        return self._version

    def _call(self, *call):
        self.calls.append(call)
        if self.lost:
            raise SamplerLostError("gone")

    def submit(self, prompt, params):
        self._call("submit", prompt)
        self.next_id += 1
        self.live.add(self.next_id - 1)
        return self.next_id - 1

    def continue_request(self, request_id, appended, params):
        self._call("continue", request_id)
        return request_id

    def restart_request(self, request_id, keep, appended, params):
        self._call("restart", request_id, keep)
        return request_id

    def release(self, request_id):
        self._call("release", request_id)
        self.live.discard(request_id)

    def poll(self, max_steps=8):
        self._call("poll")
        done, self.finished = self.finished, []
        return [Completion(request_id=r, prompt=[], start_position=0) for r in done]

    def sync_weights(self, wait_for=None, timeout_s=600.0):
        self._call("sync", wait_for)
        return self._version

    def stats(self):
        return {"generated_tokens": 10 * (self._version + 1), "weight_updates": 1}


def test_requests_balance_over_samplers_and_stay_on_theirs():
    a, b = FakeSampler(3), FakeSampler(5)
    group = SamplerGroup([a, b])
    assert (group.num_slots, group.max_len, group.version) == (4, 100, 3)
    ids = [group.submit([i], None) for i in range(4)]
    assert ids == [0, 1, 2, 3]  # alternating: a's 0, b's 0, a's 1, b's 1
    assert (a.live, b.live) == ({0, 1}, {0, 1})
    assert group.continue_request(3, [9], None) == 3 and b.calls[-1] == ("continue", 1)
    assert group.restart_request(2, 5, [9], None) == 2 and a.calls[-1] == ("restart", 1, 5)
    group.release(0)
    assert a.live == {1}
    assert group.submit([7], None) == 4  # a now holds fewer: its local id 2
    a.finished, b.finished = [2], [1]
    assert sorted(c.request_id for c in group.poll()) == [3, 4]
    assert group.sync_weights(wait_for=3) == 3 and ("sync", 3) in b.calls
    assert group.stats() == {"generated_tokens": 100, "weight_updates": 2}
    b._version = None
    assert group.version is None


@pytest.mark.parametrize("lost_during", ["poll", "submit"])
def test_a_lost_sampler_frees_the_others_requests_and_is_reraised(lost_during):
    a, b = FakeSampler(0), FakeSampler(0)
    group = SamplerGroup([a, b])
    for i in range(3):
        group.submit([i], None)
    b.lost = True
    with pytest.raises(SamplerLostError):
        if lost_during == "poll":
            group.poll()
        else:
            group.submit([9], None)  # b holds fewer requests: the new one goes there
    assert a.live == set()  # released, so the restarted samples find free slots
    assert not any(call[0] == "release" for call in b.calls)
    b.lost = False
    assert group.submit([1], None) == 4  # nothing live anywhere: a again, its local id 2
