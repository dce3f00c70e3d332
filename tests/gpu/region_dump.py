"""Prints a vgpu / HAMi-core shared region (layout 1.2): devices with limits, and every live
process slot with its memory by kind. Usage: region_dump.py PATH"""
import struct
import sys

data = open(sys.argv[1], "rb").read()
flag, major, minor = struct.unpack_from("<iII", data, 0)
device_num = struct.unpack_from("<Q", data, 56)[0]
print(f"region {sys.argv[1]}: flag {flag} version {major}.{minor} devices {device_num}")
for d in range(min(device_num, 16)):
    uuid = data[64 + 96 * d: 64 + 96 * (d + 1)].split(b"\0")[0].decode()
    limit = struct.unpack_from("<Q", data, 1600 + 8 * d)[0]
    print(f"  device {d} {uuid} limit {limit >> 20} MiB")
proc_num = struct.unpack_from("<i", data, 2008896)[0]
for s in range(min(max(proc_num, 0), 1024)):
    base = 1856 + 1960 * s
    pid, hostpid = struct.unpack_from("<ii", data, base)
    status = struct.unpack_from("<i", data, base + 1928)[0]
    if status == 0:
        continue
    parts = []
    for d in range(min(device_num, 16)):
        context, module, data_size, _offset, total = struct.unpack_from("<5Q", data, base + 8 + 64 * d)
        if total:
            parts.append(f"dev{d}: context {context >> 20} module {module >> 20} data {data_size >> 20} total {total >> 20} MiB")
    print(f"  slot {s} pid {pid} status {status}: " + ("; ".join(parts) or "nothing charged"))
