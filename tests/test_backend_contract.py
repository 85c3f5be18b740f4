"""The ``Backend`` contract, run against every backend (fsspec's ``tests/abstract`` idea).

One suite, one parametrized fixture: the local disk in each row layout (JSONL and objects),
fsspec's ``memory://``, S3 (moto's server), GCS (fake-gcs-server) and Azure Blob (Azurite), each a
real server the tests start (``tests/support/stores.py``). Each test talks to the interface of
:class:`rollout_capture.backends.base.Backend` only, so a backend added to the protocol table
passes it or shows which promise it breaks; ``test_store.py`` tests the store above it.
"""

from __future__ import annotations

import errno
import inspect
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pytest
from fsspec.implementations.local import LocalFileSystem

from rollout_capture.backends import (
    BACKENDS,
    DEFAULT_BACKEND,
    AzureBackend,
    Backend,
    GCSBackend,
    ListingScope,
    ObjectStoreBackend,
    PosixBackend,
    S3Backend,
    UnsafeStoreError,
    backend_class,
    capabilities_of,
    open_backend,
    proof,
)
from rollout_capture.backends.capabilities import CONDITIONAL_STORE
from rollout_capture.backends.object_store import ProcessLocalBackend
from rollout_capture.claims import Claim, claim_body, new_claim
from rollout_capture.config import check_capture_url
from rollout_capture.filesystem import (
    MissingExtraError,
    absolute_location,
    is_local,
    local_path,
    open_filesystem,
    url_scheme,
)
from rollout_capture.layouts import Layout
from rollout_capture.names import claim_name, jsonl_name, marker_name, object_name
from rollout_capture.worker_pool import sees_capture_root

from .conftest import S3, open_store

SERVED = ["gcs", "azure"]  # stores whose servers the suite starts (marked: `make test-fast` leaves them)
KINDS = [
    "local",
    "local-objects",
    "memory",
    "s3",
    *(pytest.param(k, marks=pytest.mark.integration) for k in SERVED),
]


@dataclass
class Subject:
    """A backend under test, on a fresh root, and what it should be."""

    kind: str
    url: str
    storage_options: dict[str, Any]
    backend: Backend
    layout: Layout

    def again(self) -> Backend:
        """Another backend on the same root (another writer or reader)."""
        return open_backend(self.url, self.storage_options)

    def write_rows(self, rollout_id: str, rows: list[dict[str, Any]], start: int = 0) -> None:
        """Rows as a writer of this layout lands them: JSONL lines, or one object each."""
        b = self.backend
        for seq, row in enumerate(rows, start):
            if self.layout == "jsonl":
                b.append_line(b.path(jsonl_name(rollout_id)), orjson.dumps(row) + b"\n")
            else:
                b.create(b.path(object_name(rollout_id, seq)), orjson.dumps(row))

    def claim(self, rollout_id: str, ttl_s: float = 60) -> Claim:
        claim = new_claim("call-1", ttl_s)
        self.backend.put_live(self.backend.path(claim_name(rollout_id, claim.claim_id)), claim_body(claim))
        return claim


@pytest.fixture(params=KINDS)
def subject(request: pytest.FixtureRequest, tmp_path: Path) -> Subject:
    kind: str = request.param
    options: dict[str, Any] = {}
    if kind.startswith("local"):
        url = str(tmp_path / "caps")
    elif kind == "memory":
        url = f"memory://caps-{uuid.uuid4().hex}"
    elif kind == "s3":
        s3: S3 = request.getfixturevalue("s3")
        url, options = s3.url("caps"), s3.storage_options
    else:
        served = open_store(request, kind)
        url, options = served.url("caps"), served.storage_options
    layout: Layout = "jsonl" if kind == "local" else "objects"
    return Subject(kind, url, options, open_backend(url, options), layout)


def read(backend: Backend, name: str) -> bytes | None:
    return backend.read_many([backend.path(name)])[0]


# ---------------------------------------------------------------------- what each backend is


EXPECTED: dict[str, tuple[type[Backend], dict[str, object]]] = {
    "local": (
        PosixBackend,
        {"default_layout": "jsonl", "supports_append": True, "trust_mtime": False, "folders_exist": True},
    ),
    "memory": (
        ProcessLocalBackend,
        {"default_layout": "objects", "supports_append": False, "trust_mtime": True, "folders_exist": False},
    ),
    "s3": (
        S3Backend,
        {"default_layout": "objects", "supports_append": False, "trust_mtime": True, "folders_exist": False},
    ),
}
EXPECTED["local-objects"] = EXPECTED["local"]
EXPECTED["gcs"] = (GCSBackend, EXPECTED["s3"][1])
EXPECTED["azure"] = (AzureBackend, EXPECTED["s3"][1])


def test_the_protocol_table_picks_the_class_and_its_promises(subject: Subject) -> None:
    cls, attributes = EXPECTED[subject.kind]
    assert type(subject.backend) is cls
    assert {name: getattr(subject.backend, name) for name in attributes} == attributes
    # one decision of local-or-not: the filesystem's answer, the backend chosen and its capabilities agree
    assert is_local(subject.url) is isinstance(subject.backend, PosixBackend)
    assert subject.backend.writes_in_place is is_local(subject.url) is subject.backend.capabilities.local
    assert capabilities_of(subject.url) == subject.backend.capabilities  # asked of a URL: the same answer


def test_path_names_a_file_under_the_root(subject: Subject) -> None:
    b = subject.backend
    assert not b.root.endswith("/")
    assert b.path("a-1.capture/000000000000.json") == f"{b.root}/a-1.capture/000000000000.json"
    b.create(b.path("a-1.capture/000000000000.json"), b"{}")
    assert b.exists(f"{b.root}/a-1.capture/000000000000.json")


# ---------------------------------------------------------------------- whole-file writes


def test_create_is_put_if_absent(subject: Subject) -> None:
    b = subject.backend
    path = b.path("x-1.capture/000000000001.json")
    b.create(path, b"first")
    with pytest.raises(FileExistsError):
        b.create(path, b"second")
    with pytest.raises(FileExistsError):
        subject.again().create(path, b"third")  # another writer on the same root too
    assert read(b, "x-1.capture/000000000001.json") == b"first"


def test_modified_is_the_stores_clock_where_it_is_trusted(subject: Subject) -> None:
    """Journal claims are judged by their commit's modification time where the store keeps the clock."""
    b = subject.backend
    path = b.path("_journal/claims/000000000000.jsonl")
    b.create(path, b"x")
    found, missing = b.modified([path, b.path("_journal/claims/000000000001.jsonl")])
    assert missing is None
    if b.trust_mtime:
        assert found is not None and abs(found - time.time()) < 300
    else:
        assert found is None  # never asked where the writer's own clock is the judge


def test_of_writers_racing_to_create_exactly_one_wins(subject: Subject) -> None:
    path = subject.backend.path("race.json")
    outcomes: list[str] = []
    gate = threading.Barrier(6)

    def writer(n: int) -> None:
        backend = subject.again()
        gate.wait()
        try:
            backend.create(path, f"writer {n}".encode())
            outcomes.append(f"won {n}")
        except FileExistsError:
            outcomes.append("lost")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (won,) = [o for o in outcomes if o.startswith("won")]
    assert outcomes.count("lost") == 5
    assert read(subject.backend, "race.json") == f"writer {won.split()[1]}".encode()


def test_put_writes_and_replaces(subject: Subject) -> None:
    b = subject.backend
    b.put(b.path("m.capture.incomplete"), b"")
    assert read(b, "m.capture.incomplete") == b""
    b.put(b.path("d/f.json"), b"one")
    b.put(b.path("d/f.json"), b"two")
    assert read(b, "d/f.json") == b"two"
    assert subject.again().read_many([b.path("d/f.json")]) == [b"two"]


def test_put_live_is_seen_at_once(subject: Subject) -> None:
    b = subject.backend
    path = b.path("r-1.capture.claims/abc.json")
    b.put_live(path, b"held")
    assert subject.again().read_many([path]) == [b"held"] and b.exists(path)
    assert subject.again().list_rollouts(["r-1"])["r-1"].claims[0][0] == "abc"


def test_remove_deletes_and_absent_files_are_fine(subject: Subject) -> None:
    b = subject.backend
    b.put(b.path("keep.json"), b"k")
    b.put(b.path("gone.json"), b"g")
    b.create(b.path("g-1.capture/000000000000.json"), b"{}")
    b.remove([b.path("gone.json"), b.path("never-there.json"), b.path("g-1.capture/000000000000.json")])
    b.remove([])
    b.remove([b.path("gone.json")])  # twice: still fine
    assert not b.exists(b.path("gone.json"))
    assert not b.exists(b.path("g-1.capture/000000000000.json"))
    assert b.exists(b.path("keep.json"))


# ---------------------------------------------------------------------- reading files


def test_read_many_keeps_order_and_gives_none_for_missing(subject: Subject) -> None:
    b = subject.backend
    assert b.read_many([]) == []
    b.put(b.path("a.json"), b"A")
    b.put(b.path("sub/b.json"), b"B" * 100_000)
    got = b.read_many([b.path("sub/b.json"), b.path("missing.json"), b.path("a.json"), b.path("no/such")])
    assert got == [b"B" * 100_000, None, b"A", None]


def test_read_iter_hands_over_what_read_many_gives_in_order(subject: Subject) -> None:
    """A long read pipelined (more paths than requests in flight), and one closed half-way."""
    b = subject.backend
    paths = [b.path(f"it/{n:03d}.json") for n in range(90)]
    for n in range(0, 90, 3):
        b.put(paths[n], b"%d" % n)
    assert list(b.read_iter([])) == []
    assert (
        list(b.read_iter(paths))
        == b.read_many(paths)
        == [b"%d" % n if n % 3 == 0 else None for n in range(90)]
    )
    stream = b.read_iter(paths)
    assert [next(stream) for _ in range(4)] == [b"0", None, None, b"3"]
    stream.close()


def test_exists(subject: Subject) -> None:
    b = subject.backend
    assert not b.exists(b.path("f.json"))
    b.put(b.path("f.json"), b"1")
    assert b.exists(b.path("f.json"))
    assert not b.exists(b.path("f.json/below")) and not b.exists(b.path("nothing/here.json"))


def test_existing_says_which_of_several_files_exist(subject: Subject) -> None:
    """In order, however the backend asks (S3: one LIST from just before the first name)."""
    b = subject.backend
    names = [f"_journal/{n:012d}.jsonl" for n in range(6)]
    for n in (1, 2, 5):
        b.create(b.path(names[n]), b"x")
    b.create(b.path("_journal/000000000003.jsonl.tmp"), b"between")  # sorts among them
    for n in range(20):  # a subfolder's keys sort after the numbers (the claims stream's): more than a page
        b.create(b.path(f"_journal/claims/{n:012d}.jsonl"), b"c")
    assert b.existing([b.path(name) for name in names[1:]]) == [True, True, False, False, True]
    assert b.existing([b.path(names[0])]) == [False] and b.existing([]) == []


def test_list_names_is_one_level_of_each_folder(subject: Subject) -> None:
    b = subject.backend
    b.put(b.path("d/a.json"), b"abc")
    b.put(b.path("d/sub/b.json"), b"x")
    top, inside, missing = b.list_names([b.root, b.path("d"), b.path("missing")])
    assert missing == {}
    assert sorted(inside) == ["a.json", "sub"]
    assert inside["a.json"].path == b.path("d/a.json") and not inside["a.json"].folder
    assert inside["a.json"].size == 3 and inside["a.json"].mtime is not None
    assert inside["sub"].folder and inside["sub"].path == b.path("d/sub")
    assert sorted(top) == ["d"] and top["d"].folder
    assert b.list_names([]) == []


def test_root_found_means_a_folder_on_a_disk_and_a_key_on_a_store(subject: Subject) -> None:
    b = subject.backend
    assert not b.root_found()  # a mistyped root must not read as an empty run
    b.put(b.path("x.json"), b"1")
    assert b.root_found()
    b.remove([b.path("x.json")])
    assert b.root_found() is b.folders_exist  # an empty folder is still there only on a disk


def test_folders_exist_says_whether_a_folder_outlives_its_files(subject: Subject) -> None:
    b = subject.backend
    b.put(b.path("e/x.json"), b"1")
    b.remove([b.path("e/x.json")])
    (top,) = b.list_names([b.root])
    assert ("e" in top) is b.folders_exist


# ---------------------------------------------------------------------- appends


def test_append_line_where_supported_else_refused(subject: Subject) -> None:
    b = subject.backend
    path = b.path(jsonl_name("7-1"))
    if not b.supports_append:
        with pytest.raises(OSError) as raised:
            b.append_line(path, b"{}\n")
        assert raised.value.errno == errno.EOPNOTSUPP
        blocking, _ = b.append_line_staged(path, b"{}\n")
        with pytest.raises(OSError):
            blocking()
        assert not b.exists(path)
        return
    b.append_line(path, b'{"n": 1}\n')
    subject.again().append_line(path, b'{"n": 2}\n')
    blocking, finish = b.append_line_staged(path, b'{"n": 3}\n')
    blocking()
    finish()
    assert read(b, jsonl_name("7-1")) == b'{"n": 1}\n{"n": 2}\n{"n": 3}\n'


def test_appends_of_concurrent_writers_never_interleave(subject: Subject) -> None:
    path = subject.backend.path(jsonl_name("8-1"))
    refused: list[int] = []

    def writer(n: int) -> None:
        backend = subject.again()
        for i in range(20):
            try:
                backend.append_line(path, orjson.dumps({"w": n, "i": i, "pad": "x" * 20_000}) + b"\n")
            except OSError:
                refused.append(n)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    data = read(subject.backend, jsonl_name("8-1"))
    if not subject.backend.supports_append:  # every append refused, nothing landed
        assert len(refused) == 80 and data is None
        return
    assert refused == []
    assert data is not None
    lines = [orjson.loads(line) for line in data.splitlines()]
    assert sorted((row["w"], row["i"]) for row in lines) == [(n, i) for n in range(4) for i in range(20)]
    for n in range(4):  # each writer's lines in its order
        assert [row["i"] for row in lines if row["w"] == n] == list(range(20))


# ---------------------------------------------------------------------- rollouts


ROWS = [{"model_call_id": f"c{i}", "n": i} for i in range(3)]


def populate(subject: Subject) -> Claim:
    """1-1 with rows, a marker and a claim; 1-10 (a name 1-1 is a prefix of) with one row; a foreign file."""
    b = subject.backend
    subject.write_rows("1-1", ROWS)
    b.put(b.path(marker_name("1-1")), b"")
    claim = subject.claim("1-1")
    subject.write_rows("1-10", ROWS[:1])
    b.put(b.path("notes.txt"), b"not a capture")
    return claim


def row_paths(subject: Subject, rollout_id: str, count: int) -> list[str]:
    b = subject.backend
    if subject.layout == "jsonl":
        return [b.path(jsonl_name(rollout_id))]
    return [b.path(object_name(rollout_id, seq)) for seq in range(count)]


def test_list_rollouts_says_what_each_rollout_holds(subject: Subject) -> None:
    claim = populate(subject)
    b = subject.backend
    listed = b.list_rollouts(["1-1", "1-10", "2-0"])
    assert set(listed) == {"1-1", "1-10", "2-0"}
    one, ten, none = listed["1-1"], listed["1-10"], listed["2-0"]
    assert not none.found and none.paths() == []
    assert one.found and ten.found
    assert one.marker is not None and one.marker.path == b.path(marker_name("1-1"))
    assert ten.marker is None and ten.claims == []
    assert [(cid, e.path) for cid, e in one.claims] == [
        (claim.claim_id, b.path(claim_name("1-1", claim.claim_id)))
    ]
    if subject.layout == "jsonl":
        assert one.jsonl is not None and one.objects == []
        assert one.jsonl.size == sum(len(orjson.dumps(r)) + 1 for r in ROWS)
    else:
        assert one.jsonl is None
        assert [(seq, e.path, e.size) for seq, e in one.objects] == [
            (seq, p, len(orjson.dumps(ROWS[seq]))) for seq, p in enumerate(row_paths(subject, "1-1", 3))
        ]
    assert sorted(one.paths()) == sorted(
        [*row_paths(subject, "1-1", 3), b.path(marker_name("1-1")), b.path(claim_name("1-1", claim.claim_id))]
    )
    assert b.list_rollouts([]) == {}


def test_list_rollouts_is_never_from_a_cache(subject: Subject) -> None:
    b = subject.backend
    subject.write_rows("3-0", ROWS[:1])
    before = b.list_rollouts(["3-0"])["3-0"]
    subject.write_rows("3-0", ROWS[1:2], start=1)
    after = b.list_rollouts(["3-0"])["3-0"]
    if subject.layout == "jsonl":
        assert before.jsonl is not None and after.jsonl is not None and after.jsonl.size > before.jsonl.size
    else:
        assert len(before.objects) == 1 and len(after.objects) == 2


def test_many_ids_are_listed_alike_whichever_way_the_backend_lists(subject: Subject) -> None:
    """Forty ids make an object store try one flat listing; a few are listed one by one: same answer."""
    populate(subject)
    many = ["1-1", "1-10", *(f"{i}-9" for i in range(40))]
    few = subject.backend.list_rollouts(["1-1", "1-10"])
    flat = subject.again().list_rollouts(many)
    assert {r: v for r, v in flat.items() if v.found} == few
    assert set(flat) == set(many)


def test_fetch_reads_a_batch_rollout_by_rollout(subject: Subject) -> None:
    claim = populate(subject)
    fetched = subject.backend.fetch(["1-1", "1-10", "2-0"])
    assert fetched.found("1-1") and fetched.found("1-10") and not fetched.found("2-0")
    one = fetched.snapshot("1-1")
    assert [row for _, row in one.rows] == ROWS and one.damaged == [] and one.incomplete
    assert [c.claim_id for c in one.claims] == [claim.claim_id]
    ten = fetched.snapshot("1-10")
    assert [row for _, row in ten.rows] == ROWS[:1] and not ten.incomplete and ten.claims == []
    assert not fetched.snapshot("2-0").found
    assert {r: [c.claim_id for c in cs] for r, cs in fetched.claims().items()} == {"1-1": [claim.claim_id]}


def test_refresh_reads_what_landed_since(subject: Subject) -> None:
    populate(subject)
    fetched = subject.backend.fetch(["1-10", "2-0"])
    subject.write_rows("1-10", ROWS[1:], start=1)
    subject.write_rows("2-0", ROWS[:1])
    fetched.refresh(["1-10", "2-0"])
    assert [row for _, row in fetched.snapshot("1-10").rows] == ROWS
    assert fetched.found("2-0") and [row for _, row in fetched.snapshot("2-0").rows] == ROWS[:1]


def test_a_jobs_batches_share_a_listing_until_its_scope_ends(subject: Subject) -> None:
    populate(subject)
    b = subject.backend
    job = ListingScope(key=f"job-{uuid.uuid4().hex}", rollouts=1000)
    assert b.fetch(["1-1"], scope=job).found("1-1")
    assert b.listed_rollout_ids(job.key) == {"1-1", "1-10"}  # the foreign file is nobody's
    subject.write_rows("5-0", ROWS[:1])
    b.end_scope(job.key)
    fetched = b.fetch(["5-0", "1-10"], scope=job)  # a new job under the old key: listed afresh
    assert fetched.found("5-0") and fetched.found("1-10")
    assert b.listed_rollout_ids(f"never-{uuid.uuid4().hex}") in (None, {"1-1", "1-10", "5-0"})


def test_claims_are_read_now_for_the_rollouts_that_have_any(subject: Subject) -> None:
    claim = populate(subject)
    b = subject.backend
    got = b.claims(["1-1", "1-10", "2-0"])
    assert list(got) == ["1-1"]
    (read_back,) = got["1-1"]
    assert read_back.claim_id == claim.claim_id and read_back.model_call_id == "call-1"
    assert read_back.ttl_s == 60 and abs(read_back.claimed_at - claim.claimed_at) < 1e-6
    b.remove([b.path(claim_name("1-1", claim.claim_id))])
    assert b.claims(["1-1"]) == {}


def test_clear_rollouts_deletes_everything_of_them_and_nothing_else(subject: Subject) -> None:
    populate(subject)
    b = subject.backend
    b.clear_rollouts(["1-1", "2-0"])  # 2-0 holds nothing: fine
    listed = b.list_rollouts(["1-1", "1-10"])
    assert not listed["1-1"].found
    assert listed["1-10"].found and b.exists(b.path("notes.txt"))
    b.clear_rollouts([])


def test_put_if_absent_is_proven_before_the_first_create_and_leaves_nothing(subject: Subject) -> None:
    """A store creating by a conditional request is proven to refuse a second create once, by its
    first create in the process: the probe is gone after, the create landed."""
    proof.forget_proofs()
    b = subject.backend
    key = b.store_key()
    b.create(b.path("p-1.capture/000000000000.json"), b"{}")
    assert (key in proof._outcomes) is b.capabilities.proven_before_use
    if b.capabilities.proven_before_use:
        assert proof._outcomes[key] is None  # proven: a dictionary lookup from now on
        assert subject.again().store_key() == key  # another root object on the store: the same store
    (top,) = b.list_names([b.root])
    assert sorted(top) == ["p-1.capture"]  # the probe left nothing behind


# ---------------------------------------------------------------------- the table itself


def test_the_table_covers_each_protocol_and_defaults_to_the_generic_store() -> None:
    assert backend_class(LocalFileSystem()) is PosixBackend
    assert backend_class(fsspec.filesystem("memory")) is ProcessLocalBackend
    assert backend_class(fsspec.filesystem("s3", anon=True, skip_instance_cache=True)) is S3Backend
    dirfs = fsspec.filesystem("dir", path=f"/dirfs-{uuid.uuid4().hex}", target_protocol="memory")
    assert backend_class(dirfs) is DEFAULT_BACKEND is ObjectStoreBackend
    assert BACKENDS["gs"] is BACKENDS["gcs"] is GCSBackend
    assert BACKENDS["az"] is BACKENDS["abfs"] is BACKENDS["abfss"] is AzureBackend
    proven = {protocol for protocol, c in BACKENDS.items() if c.capabilities.proven_before_use}
    assert proven == {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"}
    assert BACKENDS["memory"].capabilities.put_if_absent == "process-lock"
    assert (
        capabilities_of("dir://caps") == DEFAULT_BACKEND.capabilities
        and not capabilities_of("sftp://h/c").writable
    )


def test_the_default_backend_reads_but_refuses_every_unsafe_write() -> None:
    options = {"path": f"/dirfs-{uuid.uuid4().hex}", "target_protocol": "memory"}
    fsspec.filesystem("memory").pipe_file(f"{options['path']}/caps/{jsonl_name('1-0')}", b'{"a": 1}\n')
    backend = open_backend("dir://caps", options)
    assert type(backend) is ObjectStoreBackend
    with pytest.raises(UnsafeStoreError, match="dir://caps cannot be written"):
        backend.refuse_unsafe_writes()
    with pytest.raises(UnsafeStoreError):
        backend.create(backend.path("x.json"), b"1")
    assert not backend.exists(backend.path("x.json"))
    assert [row for _, row in backend.fetch(["1-0"]).snapshot("1-0").rows] == [{"a": 1}]


def test_s3_requests_are_its_own_and_the_generic_store_names_no_store() -> None:
    """S3's hooks live on S3Backend; the generic class speaks fsspec only (the seam's split)."""
    hooks = {
        "_listed_files",
        "_list_names_of",
        "_read_kwargs",
        "capabilities",
        "conditional_request",
        "endpoint",
    }
    assert {name for name in hooks if name in vars(S3Backend)} == hooks
    assert ObjectStoreBackend._read_kwargs == {} and not ObjectStoreBackend.capabilities.writable
    source = inspect.getsource(ObjectStoreBackend)
    assert [word for word in ("_s3", "is_s3", "_iterdir", "s3fs", "max_concurrency") if word in source] == []


# ---------------------------------------------------------------------- local or not: one answer


@pytest.mark.parametrize(
    ("where", "path"),
    [
        ("caps", "caps"),
        ("/data/caps", "/data/caps"),
        ("file:///data/caps", "/data/caps"),
        ("file://caps", "caps"),
        ("s3://bucket/caps", None),
        ("memory://caps", None),
        ("dir://caps", None),
    ],
)
def test_one_function_says_whether_a_location_is_this_machines_disk(where: str, path: str | None) -> None:
    assert local_path(where) == path
    assert is_local(where) is (path is not None)
    assert url_scheme(where) == (None if "://" not in where else where.split("://")[0])
    dirfs = {"path": "/dirfs-local-or-not", "target_protocol": "memory"}
    fs, _ = open_filesystem(where, dirfs if where.startswith("dir") else None)
    assert is_local(fs) is (path is not None)  # the URL's answer and the opened filesystem's agree


def test_the_callers_of_the_seam_ask_it_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers, config and the capture-root check all take the filesystem's one answer."""
    monkeypatch.chdir(tmp_path)
    assert absolute_location("caps") == str(tmp_path / "caps")
    assert absolute_location("file://caps") == f"file://{tmp_path / 'caps'}"
    assert absolute_location("memory://caps") == "memory://caps"
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / jsonl_name("1-0")).write_bytes(b"{}\n")
    assert sees_capture_root(str(tmp_path / "full")) and sees_capture_root(f"file://{tmp_path / 'full'}")
    assert not sees_capture_root(str(tmp_path / "empty")) and not sees_capture_root(str(tmp_path / "none"))
    assert not sees_capture_root("s3://bucket/caps")  # an object store: nothing to see here
    assert check_capture_url("file:///data/caps") == "file:///data/caps"
    assert check_capture_url("/data/caps") == "/data/caps"
    with pytest.raises(ValueError, match="must be an absolute path or a URL"):
        check_capture_url("caps")
    with pytest.raises(ValueError, match="unknown storage scheme 'nope'"):
        check_capture_url("nope://caps")


# ---------------------------------------------------------------------- put-if-absent, proven


class _Overwriting(ObjectStoreBackend):
    """A store taking a conditional create and ignoring its condition (as rclone serve s3 does), on memory."""

    capabilities = CONDITIONAL_STORE
    conditional_request = "a create that must fail when the file exists"
    creates = 0

    def create_unproven(self, path: str, data: bytes) -> None:
        type(self).creates += 1
        self.fs.pipe_file(path, data)  # the condition ignored: replaces


def test_a_store_that_takes_a_second_create_is_refused_once_and_for_all() -> None:
    proof.forget_proofs()
    fs = fsspec.filesystem("memory")
    backend = _Overwriting(fs, f"/overwriting-{uuid.uuid4().hex}")
    with pytest.raises(UnsafeStoreError, match="accepted a second create of one object") as refused:
        backend.create(backend.path("r-1.capture/000000000000.json"), b"{}")
    assert f"capture store memory://{backend.root} cannot be written" in str(refused.value)
    assert "(endpoint memory)" in str(refused.value) and "write to AWS S3, MinIO" in str(refused.value)
    assert not fs.exists(backend.root) or fs.find(backend.root) == []  # the probe removed, the row never sent
    assert _Overwriting.creates == 2
    with pytest.raises(UnsafeStoreError):  # learnt once: no request again in this process
        _Overwriting(fs, f"{backend.root}/other").create(backend.path("x.json"), b"{}")
    assert _Overwriting.creates == 2
    assert backend.read_many([backend.path("nothing.json")]) == [None]  # reading it is fine


def test_a_store_whose_filesystem_is_missing_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("Install adlfs to access Azure Datalake Gen2 and Azure Blob Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", not_installed)
    with pytest.raises(MissingExtraError, match=r"az:// needs the azure extra .*'rollout-capture\[azure\]'"):
        open_filesystem("az://container/caps")
    with pytest.raises(MissingExtraError, match=r"'rollout-capture\[gcs\]'"):
        open_filesystem("gs://bucket/caps")


def test_azure_credentials_never_travel_in_storage_options() -> None:
    for secret in (
        {"connection_string": "DefaultEndpointsProtocol=https;AccountKey=x"},
        {"account_key": "x"},
    ):
        with pytest.raises(ValueError, match="looks like a secret"):
            open_filesystem("az://container/caps", secret)


@pytest.mark.parametrize(
    "environment",
    [
        {
            "AZURE_STORAGE_CONNECTION_STRING": "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;"
            "SharedAccessSignature=sv=2021-08-06&ss=b&sp=rwdlac&se=2099-01-01&sig=SAS-SIGNATURE%3D"
        },
        {
            "AZURE_STORAGE_ACCOUNT_NAME": "acct",
            "AZURE_STORAGE_SAS_TOKEN": "sv=2021-08-06&sig=SAS-SIGNATURE%3D",
        },
    ],
    ids=["connection-string", "sas-token"],
)
def test_a_sas_token_never_shows_in_the_refusal_of_a_store(
    environment: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Azure account reached with a SAS token: its service client's URL carries the token as its
    query; the refusal of a store taking a second create names the endpoint without it (no request
    is made: both creates are taken, as a store ignoring If-None-Match would)."""
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(AzureBackend, "create_unproven", lambda self, path, data: None)
    monkeypatch.setattr(AzureBackend, "remove", lambda self, paths: None)
    proof.forget_proofs()
    fsspec.get_filesystem_class("az").clear_instance_cache()  # an instance reads the environment once
    backend = open_backend(f"az://c-{uuid.uuid4().hex[:8]}/caps")
    assert "sig=" in backend.fs.service_client.url  # where the token rides
    with pytest.raises(UnsafeStoreError, match="accepted a second create of one object") as refused:
        backend.create(backend.path("r-1.capture/000000000000.json"), b"{}")
    message = str(refused.value)
    assert "SAS-SIGNATURE" not in message and "sig=" not in message and "sv=" not in message
    host = (
        "http://127.0.0.1:9/devstoreaccount1/"
        if "AZURE_STORAGE_CONNECTION_STRING" in environment
        else ("https://acct.blob.core.windows.net/")
    )
    assert f"(endpoint {host})" in message
    proof.forget_proofs()
    fsspec.get_filesystem_class("az").clear_instance_cache()
