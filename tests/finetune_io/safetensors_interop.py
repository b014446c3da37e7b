#!/usr/bin/env python3
"""An independent safetensors writer and reader, with only json and struct,
to show that strata's files are the format others read and write.

  safetensors_interop.py write OUT      writes TENSORS (unpadded header,
                                        entries not in data order, metadata)
  safetensors_interop.py dump IN OUT    reads IN and writes its tensors as
                                        JSON {name: {dtype, shape, values}}
                                        and its metadata under __metadata__
"""
import json
import struct
import sys

# Values exact in their dtype, so both sides compare with ==.
TENSORS = [
    ("transformer.wte.weight", "F32", [2, 3], [0.5, -1.25, 3.0, 4.5, -0.0, 1e-7]),
    ("h.0.attn.c_attn.bias", "F16", [4], [1.0, -2.5, 0.0999755859375, 65504.0]),
    ("ln_f.weight", "BF16", [3], [1.0, -3.0, 3.140625]),
    ("count", "I32", [2], [7, -9]),
    ("empty", "F32", [0], []),
]
STRUCT = {"F32": "f", "F16": "e", "I32": "i", "F64": "d", "I64": "q"}
SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "F64": 8, "I64": 8}


def pack(dtype, values):
    if dtype == "BF16":
        out = b""
        for v in values:
            bits = struct.unpack("<I", struct.pack("<f", v))[0]
            assert bits & 0xFFFF == 0, v
            out += struct.pack("<H", bits >> 16)
        return out
    return struct.pack("<%d%s" % (len(values), STRUCT[dtype]), *values)


def unpack(dtype, raw):
    n = len(raw) // SIZE[dtype]
    if dtype == "BF16":
        halves = struct.unpack("<%dH" % n, raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    return list(struct.unpack("<%d%s" % (n, STRUCT[dtype]), raw))


def write(path):
    header, data = {}, b""
    for name, dtype, shape, values in TENSORS:
        raw = pack(dtype, values)
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    # Entries in reverse data order, metadata last, no padding.
    ordered = dict(reversed(list(header.items())))
    ordered["__metadata__"] = {"format": "pt", "writer": "python"}
    text = json.dumps(ordered).encode("utf-8")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def dump(path, out):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    result = {}
    covered = 0
    for name, entry in header.items():
        if name == "__metadata__":
            result[name] = entry
            continue
        begin, end = entry["data_offsets"]
        count = 1
        for d in entry["shape"]:
            count *= d
        assert end - begin == count * SIZE[entry["dtype"]], name
        covered += end - begin
        result[name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                        "values": unpack(entry["dtype"], data[begin:end])}
    assert covered == len(data), "the data buffer is not tiled exactly"
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3])
    else:
        sys.exit("unknown command " + sys.argv[1])
