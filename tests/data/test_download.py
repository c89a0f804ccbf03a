"""jdp.data.fetch against a local HTTP server serving generated files in the published formats: download,
SHA-256 check before use, safe extraction, the cache (no second request), clear errors, and the CLIs."""
import hashlib
import http.server
import io
import socket
import threading
import zipfile

import numpy as np
import pytest

from jdp.data import download, fetch, load_movielens
from jdp.data.synthetic import planted_sequences

ROWS = [(30, 300, 4, 881250949), (7, 12, 3, 891717742), (100, 5, 1, 878887116), (7, 300, 5, 100)]


def _zip(members: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return buf.getvalue()


def _lines(sep: str, header: str | None = None) -> str:
    rows = [sep.join(map(str, r)) for r in ROWS]
    return "\n".join(([header] if header else []) + rows) + "\n"


# name -> (served file name, bytes), in the layouts GroupLens / SASRec publish
FILES = {
    "ml-100k": ("ml-100k.zip", _zip({"ml-100k/u.data": _lines("\t"), "ml-100k/README": "generated\n"})),
    "ml-1m": ("ml-1m.zip", _zip({"ml-1m/ratings.dat": _lines("::")})),
    "ml-latest-small": ("ml-latest-small.zip",
                        _zip({"ml-latest-small/ratings.csv": _lines(",", "userId,movieId,rating,timestamp")})),
    "amazon-games": ("Video.txt", "".join(f"{u} {i}\n" for u, s in enumerate(planted_sequences(
        0, n_users=60, n_items=30)[0], 1) for i in s).encode()),
}


class _Server(http.server.ThreadingHTTPServer):
    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files, self.requests = {}, []


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.requests.append(self.path)
        body = self.server.files.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    """Serves FILES on 127.0.0.1 (ephemeral port); the registry points at it with the files' SHA-256."""
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    for name, (fname, body) in FILES.items():
        srv.files[fname] = body
        entry = download.DATASETS[name]
        monkeypatch.setitem(download.DATASETS, name, download.Remote(
            f"{base}/{fname}", hashlib.sha256(body).hexdigest(), entry.kind, entry.returns, entry.requires))
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()


@pytest.mark.parametrize("name", ["ml-100k", "ml-1m", "ml-latest-small"])
def test_download_verify_extract_then_read_from_the_cache(server, tmp_path, name):
    path = fetch(name, tmp_path, progress=False)
    assert path == tmp_path / name and path.is_dir()
    d = load_movielens(path)
    assert (d.n_users, d.n_items, d.nnz) == (3, 3, 4)
    assert d.rating.tolist() == [r for _, _, r, _ in ROWS] and d.timestamp.tolist() == [t for *_, t in ROWS]
    assert (tmp_path / FILES[name][0]).read_bytes() == FILES[name][1]  # the verified archive is kept
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left
    assert server.requests == [f"/{FILES[name][0]}"]
    assert fetch(name, tmp_path, progress=False) == path
    assert len(server.requests) == 1  # second call: no network access


def test_amazon_games_file_is_read_by_the_seqrec_loader(server, tmp_path):
    from jdp.seqrec import data
    path = fetch("amazon-games", tmp_path, progress=False)
    assert path == tmp_path / "amazon-games" / "Video.txt" and path.read_bytes() == FILES["amazon-games"][1]
    ds = data.load("amazon-games", path=path)
    assert ds.n_users == 60
    assert fetch("amazon-games", tmp_path, progress=False) == path and len(server.requests) == 1


def test_env_var_sets_the_cache_and_data_dir_wins(server, tmp_path, monkeypatch):
    monkeypatch.setenv("JDP_DATA", str(tmp_path / "env"))
    assert fetch("ml-1m", progress=False) == tmp_path / "env" / "ml-1m"
    assert fetch("ml-1m", tmp_path / "arg", progress=False) == tmp_path / "arg" / "ml-1m"
    assert len(server.requests) == 2
    monkeypatch.delenv("JDP_DATA")
    assert download.cache_dir() == download.DEFAULT_CACHE.expanduser()


def test_checksum_mismatch_raises_and_leaves_no_file(server, tmp_path):
    wrong = "0" * 64
    with pytest.raises(ValueError, match=f"expected {wrong}, got {hashlib.sha256(FILES['ml-100k'][1]).hexdigest()}"):
        fetch("ml-100k", tmp_path, progress=False, sha256=wrong)
    assert list(tmp_path.iterdir()) == []
    server.files["Video.txt"] = b"1 2\n"  # the publisher's file changed: the registry hash no longer matches
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        fetch("amazon-games", tmp_path, progress=False)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_an_archive_placed_by_hand_is_checked_and_used_without_network(server, tmp_path):
    (tmp_path / "ml-1m.zip").write_bytes(FILES["ml-1m"][1])
    assert load_movielens(fetch("ml-1m", tmp_path, progress=False)).nnz == 4
    (tmp_path / "ml-100k.zip").write_bytes(b"not the archive")
    with pytest.raises(ValueError, match="ml-100k.zip: SHA-256 mismatch"):
        fetch("ml-100k", tmp_path, progress=False)
    assert server.requests == []


def test_unreachable_server_names_url_cache_and_manual_placement(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/ml-100k.zip"
    with pytest.raises(ConnectionError) as err:
        fetch("ml-100k", tmp_path, progress=False, url=url)
    msg = str(err.value)
    assert url in msg and f"Cache directory: {tmp_path}" in msg and str(tmp_path / "ml-100k.zip") in msg
    assert download.DATASETS["ml-100k"].sha256 in msg
    assert list(tmp_path.iterdir()) == []


def test_missing_hash_and_bad_arguments_are_refused(server, tmp_path):
    with pytest.raises(ValueError, match="no published SHA-256 is known for ml-10m"):
        fetch("ml-10m", tmp_path, progress=False)
    with pytest.raises(ValueError, match="name must be one of"):
        fetch("ml-25m", tmp_path)
    with pytest.raises(ValueError, match="sha256 must be 64 hexadecimal digits"):
        fetch("ml-100k", tmp_path, sha256="abc")
    assert server.requests == []


@pytest.mark.parametrize("member", ["../evil.txt", "/abs/evil.txt", "ml-100k/../../evil.txt"])
def test_zip_members_outside_the_folder_are_refused(server, tmp_path, member):
    body = _zip({"ml-100k/u.data": _lines("\t"), member: "x"})
    server.files["ml-100k.zip"] = body
    with pytest.raises(ValueError, match="unsafe member"):
        fetch("ml-100k", tmp_path / "cache", progress=False, sha256=hashlib.sha256(body).hexdigest())
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "cache" / "ml-100k").exists()


def test_altmin_data_fetches_into_the_data_dir_and_the_cli_passes_it_on(server, tmp_path, capsys):
    from jdp import cli
    from jdp.altmin.cli import load_data
    rng = np.random.default_rng(0)
    rows = [f"{u}::{i}::{rng.integers(1, 6)}::{978300000 + 10 * u + k}"
            for u in range(1, 41) for k, i in enumerate(rng.choice(np.arange(1, 31), 10, replace=False))]
    body = _zip({"ml-1m/ratings.dat": "\n".join(rows) + "\n"})
    server.files["ml-1m.zip"] = body  # 400 ratings; its hash passed explicitly
    data, rating_range, notes = load_data("ml-1m", None, data_dir=tmp_path, sha256=hashlib.sha256(body).hexdigest(),
                                          progress=False)
    assert (data.n_users, data.nnz, rating_range) == (40, 400, (1.0, 5.0))
    assert server.requests == ["/ml-1m.zip"] and (tmp_path / "ml-1m" / "ratings.dat").is_file()
    # --data-dir reaches fetch (ml-10m has no registry hash: refused before any download, exit code 2)
    assert cli.main(["altmin", "--data", "ml-10m", "--data-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "--data-sha256" in err and str(tmp_path / "c" / "ml-10M100K" / "ratings.dat") in err
    assert len(server.requests) == 1


def test_help_documents_the_cache(capsys):
    from jdp import cli
    for sub in ("altmin", "seqrec"):
        with pytest.raises(SystemExit):
            cli.main([sub, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--data-dir" in out and "JDP_DATA" in out and "~/.cache/jdp" in out


def test_planted_sequences_follow_the_planted_successor():
    seqs, succ = planted_sequences(seed=3, n_users=3000, n_items=200, mean_length=12.0, follow=0.6)
    lengths = np.array([s.size for s in seqs])
    assert lengths.min() >= 2 and abs(lengths.mean() - 12.0) < 0.5
    flat = np.concatenate(seqs)
    assert flat.min() >= 1 and flat.max() <= 200
    followed = np.concatenate([s[1:] == succ[s[:-1] - 1] for s in seqs]).mean()
    assert 0.6 <= followed < 0.66  # `follow`, plus fresh draws that hit the successor by chance
    assert all(np.array_equal(a, b) for a, b in zip(seqs, planted_sequences(seed=3, n_users=3000, n_items=200,
                                                                            mean_length=12.0, follow=0.6)[0]))
    with pytest.raises(ValueError, match="follow"):
        planted_sequences(follow=1.0)
