"""pith.Client: the job API (proto/pith/v1/job.proto) over gRPC with mutual TLS."""

import json
import os
import socket
import ssl
import stat
import time

import grpc
from google.protobuf import json_format

from pith.v1 import job_pb2, job_pb2_grpc, spec_pb2

# Every Pith gRPC channel carries messages up to this size (the servers' default).
MAX_MESSAGE_BYTES = 64 << 20
_FINAL_STATES = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED)


class Error(Exception):
    """A call the cluster refused or could not answer, or a local file it needed: `code`
    (a grpc.StatusCode) and a one-line message naming the cause, as the CLI prints it."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def to_dict(message):
    """The message as `pith ... --output json` prints it (proto field names, enums by
    name, 64-bit integers as strings, default values left out); a list of messages (what
    `status()` returns without a job) as `{"jobs": [...]}`, as `pith status` prints it."""
    if isinstance(message, (list, tuple)):
        return {"jobs": [to_dict(m) for m in message]}
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def state_name(state):
    """JOB_STATE_RUNNING -> "running", as `pith status` says it."""
    return job_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def _default_home():
    home = os.environ.get("PITH_HOME")
    if home:
        return home
    return os.path.join(os.environ.get("HOME", "/tmp"), ".pith", "local")


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _error(e, address):
    """A grpc.RpcError as a pith.Error; gRPC's UNIMPLEMENTED without text (an address
    that serves gRPC but not this call, such as a store's port) names the address."""
    details = e.details() or ""
    if e.code() == grpc.StatusCode.UNIMPLEMENTED and not details:
        details = (f"{address} does not serve this call of the coordinator's API (a store's "
                   "or a worker's port, or a coordinator older than this client?)")
    return Error(e.code(), details)


def _check_coordinator(address, ca, timeout):
    """Raises unless the TLS server at `address` presents a certificate of the CA, naming
    the address, of the coordinator's role (pith://coordinator/NAME): another certificate
    of the CA (a user's, a worker's) must not pass for the coordinator and take the calls'
    token. grpcio takes no certificate verifier of its own, so this looks once, when the
    client connects, over a TLS connection of its own (the CLI checks every handshake)."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    try:
        context = ssl.create_default_context(cadata=ca.decode())
        context.set_alpn_protocols(["h2"])
        with socket.create_connection((host, int(port)), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                names = tls.getpeercert().get("subjectAltName", ())
    except (OSError, ValueError) as e:
        raise Error(grpc.StatusCode.UNAVAILABLE,
                    f"cannot check the certificate of the coordinator at {address}: {e}") from None
    uris = [value for kind, value in names if kind == "URI" and value.startswith("pith://")]
    if not any(uri.startswith("pith://coordinator/") for uri in uris):
        raise Error(grpc.StatusCode.UNAUTHENTICATED,
                    f"the server at {address} is not the coordinator: its certificate names "
                    f"{', '.join(uris) or 'no pith:// identity'}")


def _replaceable(path, replace):
    """Raises unless `path` is missing, or (with `replace`) a regular file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise Error(grpc.StatusCode.INVALID_ARGUMENT, f"cannot look at {path}: {e.strerror}") from None
    if not replace:
        raise Error(grpc.StatusCode.ALREADY_EXISTS, f"{path} already exists and is not replaced")
    if not stat.S_ISREG(mode):
        raise Error(grpc.StatusCode.FAILED_PRECONDITION,
                    f"{path} is not a regular file (a directory, a link or a device): not replaced")


def _rpc(address, call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except grpc.RpcError as e:
        raise _error(e, address) from None


class Client:
    """A connection to a Pith coordinator's job API.

    The coordinator is `coordinator` ("host:port"), else $PITH_COORDINATOR, else the
    cluster `pith up` started ($PITH_HOME, default ~/.pith/local), else 127.0.0.1:7000.
    Calls go with the certificate in `tls_dir` (ca.pem, cert.pem, key.pem), else
    $PITH_TLS_DIR, else that local cluster's admin certificate; `token` (or $PITH_TOKEN)
    is a bearer token sent instead of a certificate, with `tls_dir` holding the CA
    ($PITH_TOKEN is not sent when `tls_dir` holds a certificate).
    `insecure=True` is plaintext, for a cluster started with --insecure on loopback.
    The same rules as the `pith` CLI, so both reach the same cluster as the same caller.
    """

    def __init__(self, coordinator=None, tls_dir=None, token=None, insecure=False,
                 timeout=10.0):
        home = _default_home()
        address = coordinator or os.environ.get("PITH_COORDINATOR")
        if not address:
            try:
                address = _read(os.path.join(home, "coordinator.address")).decode().strip()
            except OSError:
                address = ""
        self.address = address or "127.0.0.1:7000"
        self.timeout = timeout
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        if not token and not (tls_dir and os.path.exists(os.path.join(tls_dir, "cert.pem"))):
            token = os.environ.get("PITH_TOKEN")  # not over the certificate tls_dir names
        if token and len(token) > 4096:
            raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the bearer token is {len(token)} bytes; a token of pith token is 69")
        creds, ca = (None, None) if insecure else self._credentials(home, tls_dir, token)
        if creds is None:
            host = self.address.rsplit(":", 1)[0].strip("[]")
            if not (host == "localhost" or host == "::1" or host.startswith("127.")):
                raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                            f"plaintext reaches loopback addresses only, not {self.address} "
                            "(give tls_dir)")
            self._channel = grpc.insecure_channel(self.address, options=options)
        else:
            self._channel = grpc.secure_channel(self.address, creds, options=options)
        self._stub = job_pb2_grpc.JobServiceStub(self._channel)
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            ready.cancel()  # its thread stops watching before the channel closes
            self._channel.close()
            raise Error(grpc.StatusCode.UNAVAILABLE,
                        f"no connection to the coordinator at {self.address} within "
                        f"{timeout:g} s (is it up, and does its certificate name this "
                        "address?)") from None
        if ca is not None:
            try:
                _check_coordinator(self.address, ca, timeout)
            except Error:
                self._channel.close()
                raise

    @staticmethod
    def _credentials(home, tls_dir, token):
        """(channel credentials, the CA's PEM) by the CLI's rules; (None, None): plaintext
        (no certificate anywhere)."""
        tls_dir = tls_dir or os.environ.get("PITH_TLS_DIR")
        if not tls_dir:
            local = os.path.join(home, "tls", "admin")
            if not os.path.exists(os.path.join(local, "cert.pem")):
                if token:
                    raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                                "a bearer token needs tls_dir with the cluster's ca.pem")
                return None, None
            tls_dir = local
        try:
            ca = _read(os.path.join(tls_dir, "ca.pem"))
            identity = {}
            if not token and os.path.exists(os.path.join(tls_dir, "cert.pem")):
                identity = {"private_key": _read(os.path.join(tls_dir, "key.pem")),
                            "certificate_chain": _read(os.path.join(tls_dir, "cert.pem"))}
        except OSError as e:
            raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                        f"tls_dir {tls_dir}: {e.strerror}: {e.filename}") from None
        creds = grpc.ssl_channel_credentials(root_certificates=ca, **identity)
        if token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token))
        return creds, ca

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(self, spec):
        """Queues a job; `spec` is a JobSpec, a dict, a JSON string or a path to a JSON
        file (the format of `pith submit`). Returns the Job (its id: `.job_id`)."""
        if isinstance(spec, spec_pb2.JobSpec):
            message = spec
        else:
            if isinstance(spec, dict):
                try:
                    text = json.dumps(spec)
                except (TypeError, ValueError) as e:
                    raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the spec dict is not JSON: {e}") from None
            elif isinstance(spec, os.PathLike) or (
                    isinstance(spec, str) and not spec.lstrip().startswith(("{", "["))):
                try:
                    text = _read(spec).decode()
                except OSError as e:
                    raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                                f"cannot read the spec {spec}: {e.strerror}") from None
                except UnicodeDecodeError:
                    raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the spec {spec} is not UTF-8 text") from None
            elif isinstance(spec, str):
                text = spec
            else:
                raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                            "the spec is a JobSpec, a dict, JSON text or a file's path, not "
                            f"{type(spec).__name__}")
            message = spec_pb2.JobSpec()
            try:
                json_format.Parse(text, message)
            except json_format.ParseError as e:
                raise Error(grpc.StatusCode.INVALID_ARGUMENT, f"JobSpec JSON: {e}") from None
        request = job_pb2.SubmitJobRequest(spec=message)
        return _rpc(self.address, self._stub.SubmitJob, request, timeout=self.timeout).job

    def status(self, job_id=None, states=()):
        """The Job `job_id`; without one, every job (newest first), optionally only those
        in `states` (JobState values)."""
        if job_id is not None:
            return _rpc(self.address, self._stub.GetJob, job_pb2.GetJobRequest(job_id=job_id),
                        timeout=self.timeout)
        request = job_pb2.ListJobsRequest(states=list(states))
        return list(_rpc(self.address, self._stub.ListJobs, request, timeout=self.timeout).jobs)

    WATCH_RESUME_S = 60

    def watch(self, job_id, timeout=None):
        """An iterator of the job's JobEvents: the job's current state first, then one per
        committed step and one per state change; it ends once the job has ended (the last
        event says how). `timeout` (seconds, default none) bounds the whole watch. A
        dropped stream (a coordinator restart) is taken up again from the job's current
        state (steps committed meanwhile are not replayed) as soon as the coordinator is
        back, for up to WATCH_RESUME_S seconds after it dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        heard = False  # an event came: until then the first failure is raised
        dropped = None  # when the stream dropped, while taking it up again
        while True:
            if dropped is not None:
                self._await_coordinator(job_id, dropped, deadline, timeout)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            stream = self._stub.WatchJob(job_pb2.WatchJobRequest(job_id=job_id), timeout=left)
            try:
                for event in stream:
                    heard, dropped = True, None
                    yield event
                return
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
                    raise self._watch_timeout(job_id, timeout) from None
                # A coordinator going down ends the stream UNAVAILABLE or, when its
                # server cancels the call on the way out, CANCELLED.
                resumable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                if not resumable or not heard:
                    raise _error(e, self.address) from None
                dropped = dropped if dropped is not None else time.monotonic()
            finally:
                stream.cancel()
            time.sleep(0.5)

    def _await_coordinator(self, job_id, dropped, deadline, timeout):
        """Waits for the channel to the coordinator to be ready again (gRPC's reconnect
        backoff would otherwise spend the window), until WATCH_RESUME_S after `dropped`
        or the watch's deadline."""
        now = time.monotonic()
        window = dropped + self.WATCH_RESUME_S - now
        watch_ends_first = deadline is not None and deadline - now < window
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=max(0.0, deadline - now if watch_ends_first else window))
        except grpc.FutureTimeoutError:
            ready.cancel()
            if watch_ends_first:
                raise self._watch_timeout(job_id, timeout) from None
            raise Error(grpc.StatusCode.UNAVAILABLE,
                        f"the coordinator at {self.address} was gone for over "
                        f"{self.WATCH_RESUME_S} s while watching {job_id}") from None

    @staticmethod
    def _watch_timeout(job_id, timeout):
        return Error(grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"job {job_id} did not end within {timeout:g} s of watching")

    def wait(self, job_id, timeout=None):
        """Blocks until the job ends; returns the final Job. `timeout` (seconds): past it,
        pith.Error DEADLINE_EXCEEDED saying where the job stands."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def still(job):
            return Error(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"job {job_id} still {state_name(job.state)} at step "
                         f"{job.committed_step} after {timeout:g} s")

        try:
            for _ in self.watch(job_id, timeout=timeout):
                pass
        except Error as e:
            if e.code != grpc.StatusCode.DEADLINE_EXCEEDED or deadline is None:
                raise
            job = self.status(job_id)
            if job.state not in _FINAL_STATES:
                raise still(job) from None
        job = self.status(job_id)
        while job.state not in _FINAL_STATES:
            if deadline is not None and time.monotonic() > deadline:
                raise still(job)
            time.sleep(0.2)
            job = self.status(job_id)
        return job

    def cancel(self, job_id, reason="cancelled from the Python client"):
        """Stops a job; returns it."""
        request = job_pb2.CancelJobRequest(job_id=job_id, reason=reason)
        return _rpc(self.address, self._stub.CancelJob, request, timeout=self.timeout)

    def remove(self, job_id):
        """Forgets an ended job: its record, heat map and stored weights (export them
        first). FAILED_PRECONDITION for a job still running. Returns its last record."""
        request = job_pb2.RemoveJobRequest(job_id=job_id)
        return _rpc(self.address, self._stub.RemoveJob, request, timeout=self.timeout)

    def checkpoint(self, job_id, path, replace=False):
        """Downloads the job's last committed weights as safetensors to `path` (on this
        host, written whole or not at all). An existing `path` is replaced only with
        `replace` (else ALREADY_EXISTS), and only a regular file (never a directory, a
        link or a device: FAILED_PRECONDITION). Returns a CheckpointJobResponse (step,
        weights_path, bytes)."""
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise Error(grpc.StatusCode.INVALID_ARGUMENT, "checkpoint needs a file's path")
        path = os.path.abspath(path)
        _replaceable(path, replace)
        partial = f"{path}.partial-{os.getpid()}"
        stream = self._stub.DownloadCheckpoint(
            job_pb2.DownloadCheckpointRequest(job_id=job_id), timeout=3600)
        got, total, step = 0, None, 0
        try:
            with open(partial, "wb") as out:
                for chunk in stream:
                    if total is None:
                        total, step = chunk.total_bytes, chunk.step
                    out.write(chunk.data)
                    got += len(chunk.data)
                out.flush()
                os.fsync(out.fileno())
            if total is None or got != total:
                raise Error(grpc.StatusCode.DATA_LOSS,
                            f"the checkpoint stream ended after {got} of {total or 0} bytes")
            if replace:
                _replaceable(path, replace)  # again: it may have changed meanwhile
                os.replace(partial, path)
            else:
                try:
                    os.link(partial, path)  # never over a file that appeared meanwhile
                except FileExistsError:
                    raise Error(grpc.StatusCode.ALREADY_EXISTS,
                                f"{path} already exists and is not replaced") from None
                except OSError:  # a file system without hard links: checked, then renamed
                    if os.path.lexists(path):
                        raise Error(grpc.StatusCode.ALREADY_EXISTS,
                                    f"{path} already exists and is not replaced") from None
                    os.replace(partial, path)
        except grpc.RpcError as e:
            raise _error(e, self.address) from None
        except OSError as e:
            where = path if e.filename in (None, partial) else e.filename
            raise Error(grpc.StatusCode.INVALID_ARGUMENT,
                        f"cannot write {where}: {e.strerror}") from None
        finally:
            stream.cancel()
            if os.path.exists(partial):
                os.unlink(partial)
        return job_pb2.CheckpointJobResponse(step=step, weights_path=path, bytes=got)

    def cluster(self):
        """Members (stores and workers with tiers, bytes, state), moves, drains and the
        replica deficit: a ClusterStatusResponse."""
        return _rpc(self.address, self._stub.ClusterStatus, job_pb2.ClusterStatusRequest(),
                    timeout=self.timeout)

    def experts(self, job_id, layer=-1):
        """The job's expert heat map with replica counts (every layer, or one): an
        ExpertHeatResponse."""
        request = job_pb2.ExpertHeatRequest(job_id=job_id, layer=layer)
        return _rpc(self.address, self._stub.ExpertHeat, request, timeout=self.timeout)
