"""The Python client against a live Pith cluster (started by tests/e2e/python_client_test.sh):
every call, its errors, and field-for-field agreement with `pith ... --output json`.

Environment: PITH_HOME (the cluster `pith up` started), PITH_CLI (the pith binary),
PITH_TEST_TOKENS (a token file for specs), PYTHONPATH holding build/python."""

import json
import os
import shutil
import struct
import subprocess
import tempfile
import unittest

import grpc

import pith

HOME = os.environ["PITH_HOME"]
CLI = os.environ["PITH_CLI"]
TOKENS = os.environ["PITH_TEST_TOKENS"]


def spec(name, steps):
    return {
        "name": name,
        "model": {"vocab_size": 256, "seq_len": 8, "d_model": 16, "n_layer": 2, "n_head": 2,
                  "n_expert": 4, "top_k": 2, "d_ff": 32},
        "train": {"data_path": TOKENS, "batch": 4, "steps": steps, "lr": 0.01},
        "cluster": {"workers": 2, "store_replicas": 1},
    }


def cli_json(*args):
    out = subprocess.run([CLI, *args, "--output", "json"], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return json.loads(out)


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = pith.Client(timeout=10)
        cls.job = cls.client.submit(spec("py", 12))
        cls.events = list(cls.client.watch(cls.job.job_id, timeout=240))
        cls.tmp = tempfile.mkdtemp()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        shutil.rmtree(cls.tmp)

    def test_watch_reports_every_step_until_the_job_succeeds(self):
        steps = [e.step for e in self.events if e.step >= 1]
        self.assertEqual(sorted(set(steps)), list(range(1, 13)))
        self.assertEqual(self.events[-1].state, pith.JobState.Value("JOB_STATE_SUCCEEDED"))
        losses = {e.step: e.loss for e in self.events if e.step >= 1}
        self.assertLess(losses[12], losses[1])
        self.assertTrue(all(e.job_id == self.job.job_id for e in self.events))

    def test_status_agrees_with_the_cli_on_every_field(self):
        job = self.client.status(self.job.job_id)
        self.assertEqual(pith.state_name(job.state), "succeeded")
        self.assertEqual(job.committed_step, 12)
        self.assertEqual(pith.to_dict(job), cli_json("status", self.job.job_id))
        listed = {j.job_id: pith.to_dict(j) for j in self.client.status()}
        self.assertEqual(listed[self.job.job_id], pith.to_dict(job))
        cli_listed = {j["job_id"]: j for j in cli_json("status")["jobs"]}
        self.assertEqual(cli_listed[self.job.job_id], listed[self.job.job_id])
        everything = pith.to_dict(self.client.status())  # a list, as `pith status` prints it
        self.assertEqual({j["job_id"] for j in everything["jobs"]}, set(cli_listed))
        # An ended job's watch is its final event, the same from both.
        cli_events = subprocess.run([CLI, "watch", self.job.job_id, "--output", "json"],
                                    check=True, capture_output=True, text=True,
                                    timeout=60).stdout.splitlines()
        self.assertEqual([pith.to_dict(e) for e in self.client.watch(self.job.job_id)],
                         [json.loads(line) for line in cli_events])
        done = self.client.status(states=[pith.JobState.Value("JOB_STATE_SUCCEEDED")])
        self.assertIn(self.job.job_id, [j.job_id for j in done])

    def test_experts_agree_with_the_cli(self):
        heat = self.client.experts(self.job.job_id)
        self.assertEqual(len(heat.experts), 2 * 4)
        self.assertEqual(pith.to_dict(heat), cli_json("experts", self.job.job_id))
        one = self.client.experts(self.job.job_id, layer=1)
        self.assertEqual({e.expert.layer for e in one.experts}, {1})

    def test_cluster_agrees_with_the_cli(self):
        ours, theirs = pith.to_dict(self.client.cluster()), cli_json("cluster")

        def stable(d):  # leases and byte counts move between the two calls
            return {kind: sorted((m["member_id"], m["role"], m["state"], m["grpc_address"],
                                  sorted(m)) for m in d.get(kind, []))
                    for kind in ("stores", "workers")}
        self.assertEqual(stable(ours), stable(theirs))
        self.assertEqual(len(ours["stores"]), 1)
        self.assertEqual(len(ours["workers"]), 2)

    def test_checkpoint_is_the_cli_s_file_and_loads(self):
        ours = os.path.join(self.tmp, "py.safetensors")
        theirs = os.path.join(self.tmp, "cli.safetensors")
        r = self.client.checkpoint(self.job.job_id, ours)
        self.assertEqual((r.step, r.weights_path, r.bytes), (12, ours, os.path.getsize(ours)))
        subprocess.run([CLI, "checkpoint", self.job.job_id, "--out", theirs], check=True,
                       capture_output=True, timeout=60)
        with open(ours, "rb") as a, open(theirs, "rb") as b:
            self.assertEqual(a.read(), b.read())
        with self.assertRaises(pith.Error) as refused:
            self.client.checkpoint(self.job.job_id, ours)
        self.assertEqual(refused.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        self.assertEqual(self.client.checkpoint(self.job.job_id, ours, replace=True).step, 12)
        ckpt = pith.load_checkpoint(ours, framework="python")
        self.assertEqual(ckpt.spec["model"]["n_expert"], 4)
        self.assertEqual(int(ckpt.spec["train"]["steps"]), 12)
        inspect = subprocess.run([CLI, "safetensors", "inspect", ours], check=True,
                                 capture_output=True, text=True, timeout=60).stdout
        listed = {}
        for line in inspect.splitlines():
            parts = line.split(None, 2)
            if len(parts) == 3 and parts[2].startswith("["):
                listed[parts[0]] = [int(d) for d in parts[2][1:parts[2].index("]")].split(",")
                                    if d.strip()]
        self.assertEqual({n: list(t.shape) for n, t in ckpt.tensors.items()}, listed)
        self.assertTrue(any(abs(x) > 0 for x in ckpt.tensors["wte"].tolist()[0]))
        try:
            import torch
        except ImportError:
            return  # PyTorch is optional: the tensors above are the same bytes
        as_torch = pith.load_checkpoint(ours)
        for name, t in as_torch.tensors.items():
            self.assertIsInstance(t, torch.Tensor)
            self.assertEqual(t.flatten().tolist(), ckpt.tensors[name].cast("B").cast(
                ckpt.tensors[name].format).tolist())

    def test_checkpoint_replaces_only_a_regular_file(self):
        target = os.path.join(self.tmp, "target")
        with open(target, "w") as f:
            f.write("kept")
        link = os.path.join(self.tmp, "link")
        os.symlink(target, link)
        fifo = os.path.join(self.tmp, "fifo")
        os.mkfifo(fifo)
        for path in (link, fifo, self.tmp):
            with self.assertRaises(pith.Error) as e:
                self.client.checkpoint(self.job.job_id, path, replace=True)
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("is not a regular file", e.exception.message)
        self.assertTrue(os.path.islink(link))
        self.assertTrue(stat_is_fifo(fifo))
        with open(target) as f:
            self.assertEqual(f.read(), "kept")
        self.assertEqual([n for n in os.listdir(self.tmp) if ".partial-" in n], [])
        with self.assertRaises(pith.Error) as e:
            self.client.checkpoint(self.job.job_id, "")
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_a_spec_that_is_no_spec_is_an_error_not_a_crash(self):
        binary = os.path.join(self.tmp, "binary.json")
        with open(binary, "wb") as f:
            f.write(b"\xff\xfe\x00{")
        for bad, words in ((binary, "is not UTF-8 text"), (None, "not NoneType"),
                           (5, "not int"), ({"name": {1, 2}}, "the spec dict is not JSON")):
            with self.assertRaises(pith.Error) as e:
                self.client.submit(bad)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(words, e.exception.message)

    def test_cancel_ends_a_running_job(self):
        job = self.client.submit(json.dumps(spec("long", 1000000)))
        for e in self.client.watch(job.job_id, timeout=120):
            if e.step >= 2:
                break
        with self.assertRaises(pith.Error) as late:  # its own words, not gRPC's
            self.client.wait(job.job_id, timeout=1)
        self.assertEqual(late.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertIn(f"job {job.job_id} still running at step", late.exception.message)
        with self.assertRaises(pith.Error) as running:  # only an ended job goes
            self.client.remove(job.job_id)
        self.assertEqual(running.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        cancelled = self.client.cancel(job.job_id, reason="enough")
        self.assertEqual(pith.state_name(cancelled.state), "cancelled")
        last = list(self.client.watch(job.job_id, timeout=60))[-1]
        self.assertEqual(pith.state_name(last.state), "cancelled")
        self.assertEqual(pith.state_name(self.client.wait(job.job_id, timeout=60).state),
                         "cancelled")
        removed = self.client.remove(job.job_id)
        self.assertEqual(removed.job_id, job.job_id)
        with self.assertRaises(pith.Error) as gone:
            self.client.status(job.job_id)
        self.assertEqual(gone.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn("was removed", gone.exception.message)
        self.assertNotIn(job.job_id, [j.job_id for j in self.client.status()])

    def test_errors_name_their_cause(self):
        with self.assertRaises(pith.Error) as e:
            self.client.status("no-such-job")
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        bad = spec("bad", 10)
        bad["model"]["top_k"] = 9
        with self.assertRaises(pith.Error) as e:
            self.client.submit(bad)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("top_k", e.exception.message)
        with self.assertRaises(pith.Error) as e:
            self.client.submit('{"model": {"no_such_field": 1}}')
        self.assertIn("no_such_field", str(e.exception))
        with self.assertRaises(pith.Error) as e:
            self.client.submit("/no/such/spec.json")
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(pith.Error) as e:
            self.client.checkpoint(self.job.job_id, "/no/such/dir/w.safetensors")
        self.assertIn("/no/such/dir", e.exception.message)
        with self.assertRaises(pith.Error) as e:
            list(self.client.watch("no-such-job", timeout=30))
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_another_service_is_named_as_not_the_coordinator(self):
        # A store's certificate is of the CA and names the address: its role gives it away.
        with open(os.path.join(HOME, "pids")) as f:  # name pid start grpc_port metrics_port
            port = next(line.split()[3] for line in f if line.startswith("store0 "))
        address = "127.0.0.1:" + port
        with self.assertRaises(pith.Error) as e:
            pith.Client(coordinator=address, timeout=10)
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
        self.assertIn(f"the server at {address} is not the coordinator: its certificate names "
                      "pith://member/store0", e.exception.message)

    def test_a_caller_without_a_certificate_is_refused(self):
        ca_only = os.path.join(self.tmp, "ca-only")
        os.makedirs(ca_only, exist_ok=True)
        shutil.copy(os.path.join(HOME, "tls", "admin", "ca.pem"), ca_only)
        with pith.Client(tls_dir=ca_only, token="not-a-token") as anonymous:
            with self.assertRaises(pith.Error) as e:
                anonymous.status()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
        with pith.Client(tls_dir=ca_only) as anonymous:  # TLS, but no certificate
            with self.assertRaises(pith.Error) as e:
                anonymous.status()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(pith.Error) as e:
            pith.Client(insecure=True, timeout=2)
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)


def stat_is_fifo(path):
    import stat  # noqa: PLC0415
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def safetensors(path, header, data=b""):
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


class LoadCheckpointTest(unittest.TestCase):
    """load_checkpoint on files made here (no cluster)."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.path = os.path.join(self.tmp, "t.safetensors")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_every_dtype_and_shape_loads_without_torch(self):
        safetensors(self.path, {
            "h": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
            "s": {"dtype": "F32", "shape": [], "data_offsets": [4, 8]},
            "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
            "b": {"dtype": "BOOL", "shape": [2], "data_offsets": [8, 10]},
            "__metadata__": {"pith.job_spec": '{"name": "x"}', "step": "7"},
        }, struct.pack("<2e", 1.0, -2.0) + struct.pack("<f", 3.5) + b"\x01\x00")
        ckpt = pith.load_checkpoint(self.path, framework="python")
        self.assertEqual(ckpt.tensors["h"].tolist(), [0x3C00, 0xC000])  # raw half words
        self.assertEqual((ckpt.tensors["s"].shape, ckpt.tensors["s"].tolist()), ((), 3.5))
        self.assertEqual(len(ckpt.tensors["e"]), 0)
        self.assertEqual(ckpt.tensors["b"].tolist(), [True, False])
        self.assertEqual((ckpt.spec, ckpt.step), ({"name": "x"}, 7))

    def test_a_bad_entry_or_metadata_is_a_value_error_naming_the_file(self):
        ok = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
        four = b"\x00\x00\x80\x3f"
        for header, data, words in (
                ({"t": dict(ok, shape="1")}, four, "bad or unsupported entry"),
                ({"t": dict(ok, shape=[1.0])}, four, "bad or unsupported entry"),
                ({"t": dict(ok, data_offsets=[False, 4])}, four, "bad or unsupported entry"),
                ({"t": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}}, b"\x02",
                 "BOOL bytes other than 0 and 1"),
                ({"t": ok, "__metadata__": {"pith.job_spec": "{nope"}}, four, "is not JSON"),
                ({"t": ok, "__metadata__": {"pith.job_spec": "[1]"}}, four, "not a JSON object"),
                ({"t": ok, "__metadata__": {"step": "abc"}}, four, "is not a step number")):
            safetensors(self.path, header, data)
            with self.assertRaises(ValueError) as e:
                pith.load_checkpoint(self.path, framework="python")
            self.assertIn(self.path, str(e.exception))
            self.assertIn(words, str(e.exception))
        deep = b"[" * 100000
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", len(deep)) + deep)
        with self.assertRaises(ValueError) as e:
            pith.load_checkpoint(self.path, framework="python")
        self.assertIn("header is not JSON", str(e.exception))


if __name__ == "__main__":
    unittest.main(verbosity=2)
