"""Replace committed weight fixtures by recipes that tools/fixture_gen rebuilds byte for byte.

    python fixture_recipes.py LOG.pkl [LOG.pkl ...]    # logs of trace_draws.py, one per oracle script

A device call carries the tracked tree (issue 38: under 40 MiB), and random fp32 weights do not
compress.  But most of their bytes are a draw of torch's generator through one or two float32
operations (`0.05 * randn`, `randn / fan_in ** 0.5`, `0.5 + rand`), stored as float32, bfloat16 or
float16, whole or sliced into another layout's tensors.  This script finds, for every weight tensor
of every tracked fixture file, the recorded draw and the operations that give its exact bytes, and
writes `FILE.recipe`: one JSON line (the file's size and sha256, and its pieces in order) followed
by the bytes that are not draws (headers, references, quantised blocks).  Every piece is checked
here against the file's bytes; fixture_gen checks the whole file's sha256 again when it writes it.
The streams the pieces draw from (seed, and every draw before the last one used) go to
tests/fixtures/draw_streams.json.
"""
import glob
import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
MIN_PIECE_BYTES = 256  # below this a piece's JSON costs about what its bytes do
MIN_FILE_SAVING = 64 * 1024


def bf16_round(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


STORES = {  # name -> (bytes per element, f32 values -> stored bytes)
    "f32": (4, lambda v: v.astype("<f4").tobytes()),
    "bf16": (2, lambda v: (bf16_round(v).view(np.uint32) >> 16).astype("<u2").tobytes()),
    "f16": (2, lambda v: v.astype("<f2").tobytes()),
    "f32_of_bf16": (4, lambda v: bf16_round(v).astype("<f4").tobytes()),
}


def decode(raw, store):
    if store == "f32" or store == "f32_of_bf16":
        return np.frombuffer(raw, "<f4").astype(np.float32)
    if store == "bf16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, "<f2").astype(np.float32)


def apply_ops(r, ops):
    v = r
    for op, c in ops:
        c = np.float32(c)
        v = v * c if op == "mul" else v / c if op == "div" else v + c
    return v.astype(np.float32)


def near(c, ulps=3):
    """c as a float32, its neighbours, and c rounded to 1-3 significant digits (a bf16 or f16 file
    holds too few bits to fit the oracle's scale exactly; its scales are round numbers or shape's)."""
    out = [np.float32(float(f"{c:.{d}g}")) for d in (1, 2, 3) if np.isfinite(c) and c != 0]
    c = np.float32(c)
    out.append(c)
    lo = hi = c
    for _ in range(ulps):
        lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
        out += [lo, hi]
    return out


def shape_constants(shape):
    """The scales the oracle derives from a parameter's shape: 1/sqrt(fan_in) and sqrt(fan_in)."""
    numel = int(np.prod(shape)) if shape else 1
    fans = {numel // shape[0] if shape and shape[0] else numel, shape[-1] if shape else 1}
    return [f for f in fans if f > 0]


def candidate_ops(t, r, shape):
    """Operation lists worth verifying for target values t (f32) from draw r (f32)."""
    i = int(np.argmax(np.abs(r)))
    if r[i] == 0 or not np.isfinite(t[i]):
        return
    yield []
    for a in near(t[i] / r[i]):
        yield [("mul", a)]
    for b in (1.0, 0.5):
        for a in near((t[i] - b) / r[i]):
            yield [("mul", a), ("add", b)]
        yield [("add", b)]
    if t[i] != 0:
        for c in near(r[i] / t[i]):
            yield [("div", c)]
    for fan in shape_constants(shape):
        c = np.float32(fan ** 0.5)
        yield [("mul", np.float32(1.0 / fan ** 0.5))]
        yield [("div", c)]
        if t[i] != 0:
            for g in near(np.float64(t[i]) * np.float64(c) / r[i]):
                yield [("mul", g), ("div", c)]
        std = np.float32(1.0 / fan ** 0.5)
        for m in near(np.float64(t[i]) / (np.float64(std) * r[i])):
            yield [("mul", std), ("mul", m)]


def proportional(t, r, probes):
    """A quick test that t is about a * r + b for b in {0, 1, 0.5} (the forms candidate_ops tries)."""
    i, j, k = probes
    ri, rj, rk = float(r[i]), float(r[j]), float(r[k])
    for b in (0.0, 1.0, 0.5):
        ti, tj, tk = t[i] - b, t[j] - b, t[k] - b
        if all(abs(tx * ri - ti * rx) <= 0.05 * (abs(tx * ri) + abs(ti * rx)) + 1e-30
               for tx, rx in ((tj, rj), (tk, rk))):
            return True
    return False


def fits(raw, store, r, ops):
    return STORES[store][1](apply_ops(r, ops)) == raw


def find_ops(raw, store, r, shape):
    t = decode(raw, store)
    probe = slice(0, min(len(r), 64))
    for ops in candidate_ops(t, r, shape):
        if fits(raw[: (probe.stop) * STORES[store][0]], store, r[probe], ops) and fits(raw, store, r, ops):
            return ops
    return None


# ------------------------------------------------------------------------------------------
# the tensors of a fixture file: (byte offset, byte length, dtype name)
# ------------------------------------------------------------------------------------------

SAFETENSORS_STORE = {"F32": "f32", "BF16": "bf16", "F16": "f16"}


class Region:
    """One tensor's bytes in a fixture file: store is f32/bf16/f16, or q8_0 (GGML blocks)."""

    def __init__(self, offset, length, store, shape):
        self.offset, self.length, self.store, self.shape = offset, length, store, tuple(shape)


def safetensors_regions(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    base = 8 + n
    for name, info in header.items():
        if name != "__metadata__" and info["dtype"] in SAFETENSORS_STORE:
            b, e = info["data_offsets"]
            yield Region(base + b, e - b, SAFETENSORS_STORE[info["dtype"]], info["shape"])


def gguf_regions(path):
    from gguf import GGUFReader
    from gguf.constants import GGMLQuantizationType as Q

    stores = {Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q8_0: "q8_0"}
    for t in GGUFReader(path).tensors:
        if t.tensor_type in stores:
            yield Region(t.data_offset, t.n_bytes, stores[t.tensor_type], [int(x) for x in reversed(t.shape)])


def regions(path):
    if path.endswith(".safetensors"):
        return sorted(safetensors_regions(path), key=lambda r: r.offset)
    if path.endswith(".gguf"):
        return sorted(gguf_regions(path), key=lambda r: r.offset)
    return []


def q8_0_dequantized(raw):
    """gguf-py's Q8_0 dequantisation: per 32 elements an f16 scale times int8 codes, in f32."""
    blocks = np.frombuffer(raw, np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).astype("<f4").tobytes()


# ------------------------------------------------------------------------------------------
# matching
# ------------------------------------------------------------------------------------------


def row_keys(m):
    """A key per row that a positive or negative scale of the row keeps: its 2nd-4th elements over
    its first, to 5 significant digits (a float32 product moves them by ~1e-7)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = m[:, 1:4] / m[:, :1]
        e = np.floor(np.log10(np.abs(q)))
        k = np.round(q / 10.0 ** (e - 4))
    k = np.where(np.isfinite(k), k, 0).astype(np.int64)
    e = np.where(np.isfinite(e), e, 0).astype(np.int64)
    return list(zip(map(tuple, k.tolist()), map(tuple, e.tolist())))


class Pool:
    def __init__(self, logs):
        self.streams = []  # global stream list: {"seed", "calls", "usable"}
        self.by_numel = {}  # numel -> [(stream, call, shape, values, probes)]
        self.draws = []  # every usable draw: (stream, call, shape, values)
        for log in logs:
            with open(log, "rb") as f:
                doc = pickle.load(f)
            base = len(self.streams)
            self.streams += doc["streams"]
            for stream, call, kind, dtype, shape, values in doc["draws"]:
                if not doc["streams"][stream]["usable"] or values.size * 2 < MIN_PIECE_BYTES:
                    continue
                r = values.ravel()
                order = np.argsort(-np.abs(r))
                probes = [int(order[0]), int(order[len(r) // 3]), int(order[len(r) // 7])]
                self.by_numel.setdefault(r.size, []).append((base + stream, call, shape, r, probes))
                self.draws.append((base + stream, call, shape, r))
        self.used = {}  # stream -> last call used
        self.row_index = {}  # row width -> {row key: (stream, call, shape, values, row)}
        self.sources = {}  # sha256 of a kept file's tensor bytes -> (file, offset)
        self.q8_sources = {}  # sha256 of the dequantised bytes of a kept file's Q8_0 tensor -> (file, offset, length)

    def keep(self, rel, path):
        """Index a file that stays committed whole, so that copies of its tensors need not be."""
        data = open(path, "rb").read()
        for r in regions(path):
            raw = data[r.offset: r.offset + r.length]
            if r.store == "q8_0":
                self.q8_sources[hashlib.sha256(q8_0_dequantized(raw)).digest()] = (rel, r.offset, r.length)
            elif r.length >= 4096:
                self.sources.setdefault(hashlib.sha256(raw).digest(), (rel, r.offset))

    def draw_piece(self, stream, call, ops, store, first=None, count=None):
        self.used[stream] = max(self.used.get(stream, -1), call)
        piece = {"draw": [stream, call], "store": store, "ops": [[op, float(c).hex()] for op, c in ops]}
        if first is not None:
            piece.update(first=first, count=count)
        return piece

    def whole(self, raw, store):
        """A piece giving exactly `raw` from one whole draw, or None."""
        numel = len(raw) // STORES[store][0]
        t = decode(raw, store).astype(np.float64)
        for stream, call, shape, values, probes in self.by_numel.get(numel, []):
            if proportional(t, values, probes):
                ops = find_ops(raw, store, values, shape)
                if ops is not None:
                    return self.draw_piece(stream, call, ops, store)
        return None

    def rows(self, raw, store, shape):
        """Pieces giving runs of `raw`'s rows from rows of one draw (a fused weight whose rows the
        other layout reorders or splits): [(element offset, element count, piece)]."""
        width = shape[-1] if shape else 0
        if store != "f32" or width < 8 or len(raw) < 64 * 1024:
            return []
        t = decode(raw, store).reshape(-1, width).astype(np.float64)
        where = self.rows_by_key(width)
        found = [where.get(k) for k in row_keys(t)]
        out, row = [], 0
        while row < len(found):
            if found[row] is None:
                row += 1
                continue
            stream, call, dshape, values, first = found[row]
            run = 1
            while row + run < len(found) and found[row + run] is not None and found[row + run][:2] == (stream, call) \
                    and found[row + run][4] == first + run:
                run += 1
            r = values[first * width: (first + run) * width]
            ops = find_ops(raw[row * width * 4: (row + run) * width * 4], store, r, dshape)
            if ops is not None:
                out.append((row * width, run * width,
                            self.draw_piece(stream, call, ops, store, first * width, run * width)))
            row += run
        return out

    def rows_by_key(self, width):
        if width not in self.row_index:
            where = self.row_index[width] = {}
            for stream, call, dshape, values in self.draws:
                if values.size % width == 0 and dshape and dshape[-1] == width:
                    for row, k in enumerate(row_keys(values.reshape(-1, width).astype(np.float64))):
                        where.setdefault(k, (stream, call, dshape, values, row))
        return self.row_index[width]

    # A copy's source is the first kept file holding those bytes, never the file itself: files only
    # copy from files before them, so fixture_gen meets no cycle.
    def copy(self, raw, rel):
        src = self.sources.get(hashlib.sha256(raw).digest())
        return {"copy": src[0], "at": src[1], "count": len(raw)} if src and src[0] != rel else None

    def dequantized(self, raw, rel):
        src = self.q8_sources.get(hashlib.sha256(raw).digest())
        return {"copy": src[0], "at": src[1], "count": src[2], "dequantize": "q8_0"} if src and src[0] != rel else None


def region_pieces(data, region, pool, rel):
    """[(byte offset, byte length, piece)] covering what of the region is not literal."""
    raw = data[region.offset: region.offset + region.length]
    if region.length < MIN_PIECE_BYTES or region.store == "q8_0":
        return []
    for store in ([region.store, "f32_of_bf16"] if region.store == "f32" else [region.store]):
        piece = pool.whole(raw, store)
        if piece:
            return [(region.offset, region.length, piece)]
    piece = pool.copy(raw, rel) or (pool.dequantized(raw, rel) if region.store == "f32" else None)
    if piece:
        return [(region.offset, region.length, piece)]
    size = STORES[region.store][0]
    return [(region.offset + e * size, n * size, p) for e, n, p in pool.rows(raw, region.store, region.shape)]


def pieces_of(path, pool):
    data = open(path, "rb").read()
    rel = os.path.relpath(path, FIXTURES)
    pieces, literal, pos = [], bytearray(), 0
    for region in regions(path):
        for offset, length, piece in region_pieces(data, region, pool, rel):
            if offset > pos:
                pieces.append({"bytes": offset - pos})
                literal += data[pos:offset]
            pieces.append(piece)
            pos = offset + length
    if pos < len(data):
        pieces.append({"bytes": len(data) - pos})
        literal += data[pos:]
    return data, pieces, bytes(literal)


def tracked_weight_files():
    out = subprocess.run(["git", "ls-files", "tests/fixtures"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    out += [os.path.relpath(p, REPO)[: -len(".recipe")] for p in
            glob.glob(os.path.join(FIXTURES, "**", "*.recipe"), recursive=True)
            if os.path.realpath(p) == os.path.abspath(p)]  # not again through a linked folder
    return sorted({p for p in out if p.endswith((".safetensors", ".gguf"))})


def main():
    pool = Pool(sys.argv[1:])
    results, kept = [], []
    for rel in tracked_weight_files():
        path = os.path.join(REPO, rel)
        if not os.path.exists(path):
            sys.exit(f"fixture_recipes: {rel} is missing (run tools/fixture_gen first)")
        data, pieces, literal = pieces_of(path, pool)
        if len(data) - len(literal) >= MIN_FILE_SAVING:
            results.append((rel, data, pieces, literal))
        else:
            kept.append(rel)
    # then the copies (and dequantisations) of the tensors of files that stay whole
    for rel in kept:
        pool.keep(os.path.relpath(rel, "tests/fixtures"), os.path.join(REPO, rel))
    for i, (rel, data, pieces, literal) in enumerate(results):
        results[i] = (rel, *pieces_of(os.path.join(REPO, rel), pool))
    for rel in kept:
        data, pieces, literal = pieces_of(os.path.join(REPO, rel), pool)
        if len(data) - len(literal) >= MIN_FILE_SAVING:
            results.append((rel, data, pieces, literal))
    # stream ids renumbered to the used ones only, each cut after its last used draw
    used = sorted(pool.used)
    renumber = {s: i for i, s in enumerate(used)}
    streams = [{"seed": pool.streams[s]["seed"], "calls": pool.streams[s]["calls"][: pool.used[s] + 1]}
               for s in used]
    with open(os.path.join(FIXTURES, "draw_streams.json"), "w") as f:
        json.dump({"about": "torch generator streams the *.recipe fixtures draw from (tools/fixture_gen)",
                   "streams": streams}, f, separators=(",", ":"))
        f.write("\n")
    for rel, data, pieces, literal in results:
        before = os.path.join(REPO, rel + ".recipe")
        if os.path.exists(before) and len(literal) > 2 * os.path.getsize(before) + 4096:
            sys.exit(f"fixture_recipes: {rel} would commit {len(literal)} bytes, its recipe now "
                     f"{os.path.getsize(before)}: a script's draws are missing (run every oracle script, "
                     f"APUS_SA3_OFFICIAL set, so build/oracle-draws holds each one's log)")
    saved = 0
    for rel, data, pieces, literal in results:
        for p in pieces:
            if "draw" in p:
                p["draw"][0] = renumber[p["draw"][0]]
        head = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pieces": pieces}
        with open(os.path.join(REPO, rel + ".recipe"), "wb") as f:
            f.write(json.dumps(head, separators=(",", ":")).encode() + b"\n" + literal)
        saved += len(data) - len(literal)
        print(f"{rel}: {len(data)} -> {len(literal)} bytes + recipe", file=sys.stderr)
    with open(os.path.join(FIXTURES, ".gitignore"), "w") as f:
        f.write("# written by tools/fixture_gen from their recipes (tools/oracle/fixture_recipes.py lists them)\n")
        f.writelines(f"/{os.path.relpath(rel, 'tests/fixtures')}\n" for rel, *_ in sorted(results))
    subprocess.run(["git", "rm", "-q", "--cached", "--ignore-unmatch", "--", *[rel for rel, *_ in results]],
                   cwd=REPO, check=True)
    print(f"fixture_recipes: {len(results)} files, {saved / 2**20:.1f} MiB become draws", file=sys.stderr)


if __name__ == "__main__":
    main()
