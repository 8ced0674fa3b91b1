"""Reads Jane Austen's novels from Debian's r-cran-janeaustenr (data/Rdata.rdb/.rdx) without R.

Development-time helper for making golden files. The .rdx index and each .rdb record are
zlib-compressed R serializations (XDR, format 2 or 3); each novel is a character vector.
"""
import gzip
import struct
import zlib

RDATA = "/usr/lib/R/site-library/janeaustenr/data/Rdata"


class _Reader:
    def __init__(self, buf):
        self.b, self.i = buf, 0

    def int(self):
        v = struct.unpack(">i", self.b[self.i:self.i + 4])[0]
        self.i += 4
        return v

    def bytes(self, n):
        v = self.b[self.i:self.i + n]
        self.i += n
        return v


def _unserialize(buf):
    r = _Reader(buf)
    assert r.bytes(2) == b"X\n", "only XDR serializations"
    version = r.int()
    r.int(); r.int()
    if version == 3:
        r.bytes(r.int())  # native encoding name
    return _item(r)


def _item(r):
    flags = r.int()
    kind = flags & 0xFF
    has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
    if kind == 254:  # NILVALUE_SXP
        return None
    if kind == 9:  # CHARSXP
        n = r.int()
        return None if n == -1 else r.bytes(n).decode("utf-8", "replace")
    if kind == 16:  # STRSXP
        out = [_item(r) for _ in range(r.int())]
    elif kind in (10, 13, 14):  # LGLSXP, INTSXP, REALSXP
        n = r.int()
        out = list(struct.unpack(">%d%s" % (n, "d" if kind == 14 else "i"), r.bytes(n * (8 if kind == 14 else 4))))
    elif kind == 19:  # VECSXP
        out = [_item(r) for _ in range(r.int())]
    elif kind == 2:  # LISTSXP (pairlist): attr, tag, car, cdr
        items = []
        while True:
            attr = _item(r) if has_attr else None
            tag = _item(r) if has_tag else None
            items.append((tag, _item(r)))
            nxt = r.int()
            kind2 = nxt & 0xFF
            if kind2 == 254:
                break
            has_attr, has_tag = nxt & (1 << 9), nxt & (1 << 10)
        return items
    elif kind == 1:  # SYMSXP
        return _item(r)
    elif kind == 255:  # REFSXP
        return None
    else:
        raise ValueError(f"unsupported R type {kind}")
    if has_attr:
        attrs = dict(_item(r))
        if "names" in attrs and isinstance(out, list):
            return dict(zip(attrs["names"], out))
    return out


def novels():
    """Returns {name: text} with the novel's lines joined by newlines."""
    idx = _unserialize(gzip.decompress(open(RDATA + ".rdx", "rb").read()))
    rdb = open(RDATA + ".rdb", "rb").read()
    out = {}
    variables = idx["variables"] if isinstance(idx, dict) else idx[0]
    for name, (off, length) in variables.items():
        chunk = rdb[int(off):int(off) + int(length)]
        obj = _unserialize(zlib.decompress(chunk[4:]))
        if isinstance(obj, list) and obj and isinstance(obj[0], str):
            out[name] = "\n".join(s if s is not None else "" for s in obj)
    return out


if __name__ == "__main__":
    for k, v in novels().items():
        print(k, len(v))
