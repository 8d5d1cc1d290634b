"""Which client lazyload's remote reader uses: a loop of ranged GETs with each candidate,
against moto's S3 server and the tests' HTTP Range server (tests/remote_servers.py), both
on localhost in this process's threads.

  S3:   obstore (S3Store.get_range), boto3 (get_object with Range), s3fs (open + seek + read)
  HTTP: the standard library's http.client (one keep-alive connection per thread),
        urllib3 (PoolManager), obstore (HTTPStore.get_range)

Each reads N small (4 KiB) ranges at random offsets and a few 1 MiB ranges of one object,
with 1 and 8 threads, checking every byte. The servers are Python and share these cores,
so the differences are a lower bound on the clients' own.

Usage: python benchmarks/bench_clients.py [--small 300] [--object-mib 8]
Needs: pip install -e '.[remote-bench]'
"""

import argparse
import http.client
import logging
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from remote_servers import RangeServer, moto_server  # noqa: E402

MiB = 1 << 20


def measure(name, get, data, small, big):
    for label, ranges in ((f"{len(small)} x 4 KiB", small), (f"{len(big)} x 1 MiB", big)):
        for threads in (1, 8):
            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                out = list(pool.map(lambda r: get(*r), ranges))
            seconds = time.perf_counter() - t
            assert all(bytes(o) == data[a:b] for o, (a, b) in zip(out, ranges))
            print(f"| {name} | {label} | {threads} | {seconds * 1e3:.0f} |", flush=True)


def s3_clients(data, small, big):
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server, endpoint = moto_server()
    try:
        import boto3
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="bench")
        client.put_object(Bucket="bench", Key="obj", Body=data)
        import obstore
        from obstore.store import S3Store
        store = S3Store("bench", endpoint=endpoint, region="us-east-1", client_options={"allow_http": True},
                        access_key_id="bench", secret_access_key="bench")
        measure("S3: obstore", lambda a, b: obstore.get_range(store, "obj", start=a, end=b), data, small, big)
        measure("S3: boto3", lambda a, b: client.get_object(Bucket="bench", Key="obj", Range=f"bytes={a}-{b - 1}")
                ["Body"].read(), data, small, big)
        import s3fs
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})

        def s3fs_get(a, b):
            with fs.open("bench/obj", "rb", block_size=0) as f:
                f.seek(a)
                return f.read(b - a)

        measure("S3: s3fs", s3fs_get, data, small, big)
    finally:
        server.stop()


def http_clients(data, small, big):
    with tempfile.TemporaryDirectory(prefix="lazyload-bench-clients-") as root:
        _http_clients_in(root, data, small, big)


def _http_clients_in(root, data, small, big):
    with open(os.path.join(root, "obj"), "wb") as f:
        f.write(data)
    with RangeServer(root) as server:
        port, local = server.server_address[1], threading.local()

        def stdlib_get(a, b):
            conn = getattr(local, "conn", None) or setattr(local, "conn", http.client.HTTPConnection(
                "127.0.0.1", port)) or local.conn
            conn.request("GET", "/obj", headers={"Range": f"bytes={a}-{b - 1}"})
            return conn.getresponse().read()

        measure("HTTP: http.client", stdlib_get, data, small, big)
        import urllib3
        pool = urllib3.PoolManager(maxsize=16)
        measure("HTTP: urllib3", lambda a, b: pool.request("GET", server.url + "/obj",
                                                           headers={"Range": f"bytes={a}-{b - 1}"}).data,
                data, small, big)
        import obstore
        from obstore.store import HTTPStore
        store = HTTPStore.from_url(server.url, client_options={"allow_http": True})
        measure("HTTP: obstore", lambda a, b: obstore.get_range(store, "obj", start=a, end=b), data, small, big)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=300, help="4 KiB GETs per run")
    parser.add_argument("--object-mib", type=int, default=8)
    args = parser.parse_args()
    size = args.object_mib * MiB
    data = os.urandom(size)
    rng = random.Random(0)
    small = [(o, o + 4096) for o in rng.sample(range(0, size - 4096, 4096), args.small)]
    big = [(i * MiB, (i + 1) * MiB) for i in range(min(8, args.object_mib))]
    print("| client | GETs | threads | ms |\n|---|---|---|---|")
    s3_clients(data, small, big)
    http_clients(data, small, big)


if __name__ == "__main__":
    main()
