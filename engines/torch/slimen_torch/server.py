"""The gRPC server of the slimen engine protocol (engines/proto/engine.proto) over an Engine.

What the protocol adds to the engine lives here: request-id and step-id idempotency, routing of
completions to the Generate streams waiting for them, the bearer token, and health while the model
loads. The server listens before the model is loaded (Health says NOT_SERVING, other calls are
UNAVAILABLE, which clients retry), so a supervisor can tell a slow start from a dead one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hmac
import ipaddress
import logging
import os
import queue
import secrets
import threading
import time

import grpc

from . import lora
from .launch import exit_now
from .proto import engine_pb2 as pb
from .proto import engine_pb2_grpc as pb_grpc
from .types import Batch, GenerateRequest, LossConfig, RequestError, Sample, Sampling, ScoreRequest

log = logging.getLogger("slimen_torch")

PROTOCOL_VERSION = 1
GENERATE_MEMORY_S = 600  # finished generate requests are remembered this long
TRAIN_MEMORY = 512  # step ids remembered
MAX_MESSAGE_BYTES = 64 << 20
# The response header naming the server process (the `instance` of Info and Health) on every
# answer, the Generate stream's included (engines/proto/doc.go, InstanceHeader): a client that sees
# it change knows that the engine restarted, without a Health call.
INSTANCE_HEADER = "slimen-instance"


def _code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)


# ---- conversions ----

def _messages(ms) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in ms]


def generate_request(r: pb.GenerateRequest) -> GenerateRequest:
    s = r.sampling
    return GenerateRequest(
        id=r.id, messages=_messages(r.messages) or None, prompt_tokens=list(r.prompt_tokens) or None,
        n=r.n, sampling=Sampling(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                 stop=list(s.stop), seed=s.seed, constraint=s.constraint),
        adapter=r.adapter)


class Serialized:
    """A completion already in its protocol message's bytes (data), made by the rank of a worker
    group that generated it (dist.Received): the Generate stream sends the bytes as they are."""

    __slots__ = ("index", "data")

    def __init__(self, index: int, data: bytes):
        self.index, self.data = index, data


def completion_pb(c):
    """The protocol message of an engine's completion; one already serialized (Serialized) as it
    is."""
    if isinstance(c, Serialized):
        return c
    return pb.Completion(request_id=c.request_id, index=c.index, prompt_tokens=c.prompt_tokens,
                         tokens=c.tokens, logprobs=c.logprobs, text=c.text,
                         finish_reason=c.finish_reason)


def _record(field: str) -> bytes:
    """The key of a length-delimited record of GenerateStreamResponse's field."""
    return bytes([pb.GenerateStreamResponse.DESCRIPTOR.fields_by_name[field].number << 3 | 2])


_COMPLETIONS, _ERRORS = _record("completions"), _record("errors")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def stream_response(comps: list, errs: list) -> bytes:
    """The serialized GenerateStreamResponse of comps (completion_pb's) and errs: a repeated
    message field is encoded as its elements' records one after another, so the bytes of a
    Serialized completion go in as they are, neither parsed nor copied into a message."""
    out = []
    for key, items in ((_COMPLETIONS, comps), (_ERRORS, errs)):
        for m in items:
            b = m.data if isinstance(m, Serialized) else m.SerializeToString()
            out += (key, _varint(len(b)), b)
    return b"".join(out)


def batch_of(b: pb.Batch) -> Batch:
    lc = b.loss
    loss = LossConfig(**{f: getattr(lc, f) for f in LossConfig.__dataclass_fields__})
    samples = [Sample(prompt=list(s.prompt), response=list(s.response), loss_mask=list(s.loss_mask),
                      old_logprobs=list(s.old_logprobs), advantages=list(s.advantages),
                      group=s.group, returns=list(s.returns), old_values=list(s.old_values),
                      train_logprobs=list(s.train_logprobs))
               for s in b.samples]
    return Batch(samples=samples, loss=loss, id=b.id)


# ---- Generate: ids, entries and streams ----

class _Entry:
    """One request id: its samples as they finish, and the streams waiting for them."""

    def __init__(self, rid: str, fingerprint: bytes, n: int):
        self.id, self.fp, self.n = rid, fingerprint, n
        self.got: list = [None] * n
        self.ngot = 0
        self.error = None
        self.subs: set[_Session] = set()
        self.finished_at = 0.0

    @property
    def done(self) -> bool:
        return self.error is not None or self.ngot == self.n


class _Session:
    """One Generate stream: completions for it queue here until its handler sends them."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.waiting: dict[str, _Entry] = {}  # ids this stream still expects results for
        self.recv_done = False


class _Generate:
    def __init__(self, engine_ref):
        self.engine = engine_ref  # callable returning the Engine
        self.lock = threading.Lock()
        self.entries: dict[str, _Entry] = {}
        self.finished: collections.deque[_Entry] = collections.deque()

    def submit(self, sess: _Session, r: pb.GenerateRequest) -> None:
        fp = r.SerializeToString(deterministic=True)
        with self.lock:
            self._prune()
            e = self.entries.get(r.id) if r.id else None
            if e is not None:
                if e.fp != fp:
                    sess.q.put(([], [pb.RequestError(
                        request_id=r.id, code=grpc.StatusCode.ALREADY_EXISTS.value[0],
                        message=f"request id {r.id!r} was used before for a different request")]))
                    return
                # A resent request: answer from memory, never sample again.
                done = [c for c in e.got if c is not None]
                errs = [e.error] if e.error is not None else []
                if done or errs:
                    sess.q.put((done, errs))
                if not e.done:
                    e.subs.add(sess)
                    sess.waiting[r.id] = e
                return
            e = _Entry(r.id, fp, r.n or 1)
            e.subs.add(sess)
            sess.waiting[r.id] = e
            if r.id:
                self.entries[r.id] = e
        try:
            eng, req = self.engine(), generate_request(r)
            deliver, fail = lambda c: self._deliver(e, c), lambda code, msg: self._fail(e, code, msg)
            if r.HasField("version"):  # a kept weights version, served while Train runs
                eng.submit_version(r.version, req, deliver, fail)
            else:
                eng.submit(req, deliver, fail)
        except RequestError as err:
            self._fail(e, err.code, str(err))
        except Exception as err:  # the engine's own failure, for this request only
            self._fail(e, "UNKNOWN", str(err))

    def _deliver(self, e: _Entry, c) -> None:
        msg = completion_pb(c)
        with self.lock:
            if e.got[c.index] is not None:
                return
            e.got[c.index] = msg
            e.ngot += 1
            self._notify(e, [msg], [])

    def _fail(self, e: _Entry, code: str, message: str) -> None:
        err = pb.RequestError(request_id=e.id, code=_code(code).value[0], message=message)
        with self.lock:
            if e.done:
                return
            e.error = err
            # A failed id is forgotten, so that a resend is tried again.
            if self.entries.get(e.id) is e:
                del self.entries[e.id]
            self._notify(e, [], [err])

    def _notify(self, e: _Entry, comps, errs) -> None:
        # Called with the lock held.
        for s in e.subs:
            s.q.put((comps, errs))
            if e.done:
                s.waiting.pop(e.id, None)
        if e.done:
            e.subs.clear()
            e.finished_at = time.monotonic()
            self.finished.append(e)

    def cancel(self, sess: _Session, ids) -> None:
        drop = []
        with self.lock:
            for rid in ids:
                e = sess.waiting.pop(rid, None)
                if e is None:
                    continue
                e.subs.discard(sess)
                if not e.subs and not e.done:
                    # Nobody waits for it any more: stop sampling and forget the id.
                    if self.entries.get(rid) is e:
                        del self.entries[rid]
                    drop.append(rid)
        for rid in drop:
            self.engine().cancel(rid)

    def leave(self, sess: _Session) -> None:
        # A closed stream stops listening; its requests run on so that a client that reconnects
        # and resends them gets the results from memory.
        with self.lock:
            for e in sess.waiting.values():
                e.subs.discard(sess)
            sess.waiting.clear()

    def forget_finished(self) -> None:
        with self.lock:
            for e in self.finished:
                if self.entries.get(e.id) is e:
                    del self.entries[e.id]
            self.finished.clear()

    def _prune(self) -> None:
        cutoff = time.monotonic() - GENERATE_MEMORY_S
        while self.finished and self.finished[0].finished_at < cutoff:
            e = self.finished.popleft()
            if self.entries.get(e.id) is e:
                del self.entries[e.id]


# ---- Train: step ids ----

class _Train:
    def __init__(self):
        self.lock = threading.Lock()
        self.done: collections.OrderedDict[str, pb.TrainStats] = collections.OrderedDict()
        self.running: dict[str, concurrent.futures.Future] = {}

    def run(self, bid: str, fn):
        """Returns (stats, duplicate); fn runs at most once per id."""
        if not bid:
            return fn(), False
        with self.lock:
            if bid in self.done:
                return self.done[bid], True
            fut = self.running.get(bid)
            owner = fut is None
            if owner:
                fut = self.running[bid] = concurrent.futures.Future()
        if not owner:
            return fut.result(), True
        try:
            stats = fn()
        except BaseException as e:
            with self.lock:
                del self.running[bid]
            fut.set_exception(e)
            raise
        with self.lock:
            del self.running[bid]
            self.done[bid] = stats
            while len(self.done) > TRAIN_MEMORY:
                self.done.popitem(last=False)
        fut.set_result(stats)
        return stats, False

    def forget(self) -> None:
        with self.lock:
            self.done.clear()


# ---- where Save and Load may go ----

class Refused(Exception):
    """A Save or Load folder the server refuses; code is the gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Roots:
    """The folders a client's Save and Load may name, as in the Go server (engines/server): a
    relative folder is taken from the first root, and the folder, with its symbolic links resolved,
    must lie inside one of them. No dirs is the working directory, unless that is the file
    system's root. A root need not exist yet."""

    def __init__(self, dirs=None):
        if not dirs:
            cwd = os.getcwd()
            if os.path.dirname(cwd) == cwd:
                raise ValueError(
                    f"root: the working directory is {cwd}, so by default clients could save and "
                    f"load model folders anywhere this process can; give the folder to confine "
                    f"them to (--root DIR; --root {cwd} to allow it)")
            dirs = [cwd]
        self.dirs = []
        for d in dirs:
            if not d:
                raise ValueError("root: an empty folder name")
            real = os.path.realpath(os.path.abspath(d))
            if os.path.exists(real) and not os.path.isdir(real):
                raise ValueError(f"root {d} is a file, not a folder")
            self.dirs.append(real)

    def describe(self) -> str:
        if len(self.dirs) == 1:
            return f"this server's root {self.dirs[0]}"
        return "this server's roots " + ", ".join(self.dirs)

    def contains(self, path: str) -> bool:
        return any(os.path.commonpath([d, path]) == d for d in self.dirs)

    def resolve(self, what: str, folder: str) -> str:
        """The path the engine gets for the folder of a Save or Load request (what: "save",
        "load"), or Refused."""
        if not folder:
            raise Refused("INVALID_ARGUMENT", f"{what}: no folder given; name a folder inside "
                          f"{self.describe()}")
        path = folder if os.path.isabs(folder) else os.path.join(self.dirs[0], folder)
        # realpath follows every symbolic link, one that points nowhere included, before it
        # applies "..", as the file system will.
        real = os.path.realpath(path)
        if not self.contains(real):
            where = f" ({real})" if real != folder else ""
            raise Refused(
                "PERMISSION_DENIED",
                f"{what}: folder {folder!r}{where} is outside {self.describe()}: a client may only "
                f"save and load model folders under the root the server was started with; give a "
                f"path inside it (relative paths are taken from {self.dirs[0]}), or start the "
                f"server with --root covering the folder")
        return real


# ---- the service ----

class Service(pb_grpc.EngineServicer):
    def __init__(self, roots: Roots | None = None):
        self.roots = roots or Roots()
        self.instance = secrets.token_hex(8)
        self.engine = None  # set once the model is loaded
        self.loading = True
        self.gen = _Generate(lambda: self.engine)
        self.train = _Train()

    def _name(self, context) -> None:
        """Sends the header that names this process (before any answer or error), as the Go
        server's stampUnary does for every unary call after the token check."""
        context.send_initial_metadata(((INSTANCE_HEADER, self.instance),))

    def _ready(self, context):
        if self.engine is None or self.loading:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is loading its model")
        return self.engine

    def _confine(self, context, what: str, folder: str) -> str:
        try:
            return self.roots.resolve(what, folder)
        except Refused as e:
            context.abort(_code(e.code), str(e))

    def _fail(self, context, err: Exception):
        if isinstance(err, RequestError):
            context.abort(_code(err.code), str(err))
        log.exception("engine call failed")
        context.abort(grpc.StatusCode.UNKNOWN, str(err))

    def Health(self, request, context):
        self._name(context)
        status = pb.HealthResponse.NOT_SERVING if self.loading else pb.HealthResponse.SERVING
        return pb.HealthResponse(status=status, protocol_version=PROTOCOL_VERSION,
                                 instance=self.instance)

    def Info(self, request, context):
        self._name(context)
        if request.protocol_version not in (0, PROTOCOL_VERSION):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the client speaks engine protocol version {request.protocol_version} "
                          f"and this server version {PROTOCOL_VERSION}")
        eng = self._ready(context)
        return pb.InfoResponse(protocol_version=PROTOCOL_VERSION, instance=self.instance,
                               info=pb.Info(**eng.info()))

    def Generate(self, request_iterator, context):
        self._ready(context)
        # The header at once, before any completion is ready: it tells the client that the stream
        # is up (the token accepted, the model loaded) and which process answers; the client
        # checks it before it sends anything.
        self._name(context)
        sess = _Session()

        def read():
            try:
                for msg in request_iterator:
                    if msg.cancel:
                        self.gen.cancel(sess, msg.cancel)
                    for r in msg.requests:
                        self.gen.submit(sess, r)
            except grpc.RpcError:
                pass  # the client went away; the handler below notices
            except Exception:
                log.exception("generate stream reader failed")
            finally:
                sess.recv_done = True
                sess.q.put(None)  # wake the sender

        reader = threading.Thread(target=read, name="slimen-torch-generate-reader", daemon=True)
        reader.start()
        try:
            while context.is_active():
                try:
                    item = sess.q.get(timeout=1.0)
                except queue.Empty:
                    continue
                items = [item]
                while True:  # several completions finished together go out in one message
                    try:
                        items.append(sess.q.get_nowait())
                    except queue.Empty:
                        break
                comps = [c for it in items if it for c in it[0]]
                errs = [e for it in items if it for e in it[1]]
                if comps or errs:
                    yield stream_response(comps, errs)
                # The client closed its side and every request it sent is answered.
                if sess.recv_done and not sess.waiting and sess.q.empty():
                    return
        finally:
            self.gen.leave(sess)

    def Score(self, request, context):
        self._name(context)
        eng = self._ready(context)
        reqs = [ScoreRequest(tokens=list(r.tokens), messages=_messages(r.messages) or None,
                             prompt_tokens=list(r.prompt_tokens) or None, reference=r.reference,
                             adapter=r.adapter)
                for r in request.requests]
        try:
            out = eng.score_version(request.version, reqs) if request.HasField("version") \
                else eng.score(reqs)
        except Exception as e:
            self._fail(context, e)
        return pb.ScoreBatchResponse(scores=[pb.Scores(logprobs=lp) for lp in out])

    def Values(self, request, context):
        self._name(context)
        eng = self._ready(context)
        reqs = [ScoreRequest(tokens=list(r.tokens), messages=_messages(r.messages) or None,
                             prompt_tokens=list(r.prompt_tokens) or None) for r in request.requests]
        try:
            out = eng.values(reqs)
        except Exception as e:
            self._fail(context, e)
        return pb.ValuesResponse(values=[pb.Scores(logprobs=v) for v in out])

    def Train(self, request, context):
        self._name(context)
        eng = self._ready(context)

        def step():
            b = batch_of(request.batch)
            b.adapter = request.adapter
            s = eng.train(b)
            return pb.TrainStats(loss=s.loss, pg_loss=s.pg_loss, kl=s.kl, clip_frac=s.clip_frac,
                                 entropy=s.entropy, grad_norm=s.grad_norm, tokens=s.tokens,
                                 value_loss=s.value_loss, skipped=s.skipped, reason=s.reason,
                                 tis_clip_frac=s.tis_clip_frac, tis_weight=s.tis_weight,
                                 logprob_diff_mean=s.logprob_diff_mean,
                                 logprob_diff_max=s.logprob_diff_max,
                                 logprob_abs_diff=s.logprob_abs_diff)
        try:
            # Adapters step apart: the same batch id of two adapters is two steps.
            bid = request.batch.id if not request.adapter else f"{request.adapter}\x00{request.batch.id}"
            stats, dup = self.train.run(bid, step)
        except Exception as e:
            self._fail(context, e)
        return pb.TrainResponse(stats=stats, duplicate=dup)

    def Render(self, request, context):
        self._name(context)
        eng = self._ready(context)
        reqs = [(_messages(r.messages), list(r.tools), r.add_generation_prompt) for r in request.requests]
        try:
            out = eng.render(reqs)
        except Exception as e:
            self._fail(context, e)
        return pb.RenderResponse(tokens=[pb.TokenIds(ids=ids) for ids in out])

    def Tokenize(self, request, context):
        self._name(context)
        eng = self._ready(context)
        return pb.TokenizeResponse(tokens=[pb.TokenIds(ids=ids) for ids in eng.tokenize(request.texts)])

    def Save(self, request, context):
        self._name(context)
        eng = self._ready(context)
        folder = self._confine(context, "save", request.dir)
        try:
            if request.HasField("version"):
                eng.save_version(request.version, folder)
            elif request.adapter:
                eng.save(folder, request.adapter)
            else:
                eng.save(folder)
        except Exception as e:
            self._fail(context, e)
        return pb.SaveResponse()

    def KeepVersion(self, request, context):
        self._name(context)
        eng = self._ready(context)
        try:
            eng.keep_version(request.version)
        except Exception as e:
            self._fail(context, e)
        return pb.VersionResponse()

    def DropVersions(self, request, context):
        self._name(context)
        eng = self._ready(context)
        try:
            eng.drop_versions(request.version)
        except Exception as e:
            self._fail(context, e)
        return pb.VersionResponse()

    def JoinPushGroup(self, request, context):
        self._name(context)
        eng = self._ready(context)
        try:
            links = eng.join_push(request.group, request.init_method, request.rank, request.world,
                                  request.timeout_s)
        except Exception as e:
            self._fail(context, e)
        return pb.PushGroupResponse(links=links)

    def PushWeights(self, request, context):
        self._name(context)
        eng = self._ready(context)
        try:
            out = eng.push_weights(request.group, request.peer, request.version)
        except Exception as e:
            self._fail(context, e)
        if out["received"]:
            # New weights, as after a Load: old completions must not answer new requests.
            self.gen.forget_finished()
        return pb.PushWeightsResponse(bytes=out["bytes"], seconds=out["seconds"], link=out["link"])

    def Load(self, request, context):
        self._name(context)
        eng = self._ready(context)
        folder = self._confine(context, "load", request.dir)
        try:
            eng.load(folder, request.adapter) if request.adapter else eng.load(folder)
        except Exception as e:
            self._fail(context, e)
        # The weights went back in time: old step ids must apply again and old completions must
        # not answer new requests.
        self.train.forget()
        self.gen.forget_finished()
        return pb.LoadResponse()

    def AddAdapter(self, request, context):
        self._name(context)
        eng = self._ready(context)
        try:
            n = eng.add_adapter(request.name, lora.LoRAConfig(
                rank=request.rank, alpha=request.alpha, dropout=request.dropout,
                targets=tuple(request.targets)), request.seed)
        except ValueError as e:
            self._fail(context, RequestError("INVALID_ARGUMENT", f"adapter {request.name!r}: {e}"))
        except Exception as e:
            self._fail(context, e)
        return pb.AddAdapterResponse(params=n)

    def RemoveAdapter(self, request, context):
        self._name(context)
        eng = self._ready(context)
        try:
            eng.remove_adapter(request.name)
        except Exception as e:
            self._fail(context, e)
        return pb.RemoveAdapterResponse()


class _TokenAuth(grpc.ServerInterceptor):
    """Refuses every call without "authorization: Bearer <token>"."""

    def __init__(self, token: str):
        self.want = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(got.encode(), self.want):
            return continuation(details)
        handler = continuation(details)
        msg = ("this engine server requires a bearer token: set the client's token environment "
               "variable to the server's token" if not got else
               "the bearer token does not match this engine server's")

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def is_loopback(host: str) -> bool:
    """Whether a listen host names this machine only: localhost or a loopback IP (names are not
    resolved, as in the Go server)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _add_service(server, service: Service) -> None:
    """Registers the service's methods on server as the generated code does, but for Generate's
    answers, which the handler yields serialized (stream_response)."""

    class Capture:
        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            self.name, self.handlers = name, dict(handlers)

    cap = Capture()
    pb_grpc.add_EngineServicer_to_server(service, cap)
    cap.handlers["Generate"] = grpc.stream_stream_rpc_method_handler(
        service.Generate, request_deserializer=pb.GenerateStreamRequest.FromString,
        response_serializer=lambda b: b)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(cap.name,
                                                                          cap.handlers),))
    server.add_registered_method_handlers(cap.name, cap.handlers)


def make_server(listen: str, token: str = "", workers: int = 32, roots=None):
    """A started server on listen (host:port; port 0 picks one) whose Save and Load stay inside
    roots (folders; None: the working directory). Returns (server, service, port).

    Off loopback it needs a token: without one anyone who reaches the port could train the model
    and make it save and load model folders."""
    host, _, port = listen.rpartition(":")
    if not host:
        raise ValueError(f"--listen {listen!r}: write it as host:port, e.g. 127.0.0.1:7777")
    if not is_loopback(host):
        if not token:
            raise ValueError(
                f"--listen {listen} is not loopback: an engine served to the network must "
                f"authenticate its clients, or anyone who reaches the port could train it and make "
                f"it save and load model folders: set a bearer token (--token-env VAR); to serve "
                f"this machine only, listen on 127.0.0.1")
        log.warning("listening on %s in plaintext: the token and all traffic cross the network "
                    "unencrypted; use a private network or a tunnel", listen)
    service = Service(Roots(roots))
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # The Go client pings every 30 s, also between calls; let it.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]
    interceptors = [_TokenAuth(token)] if token else []
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=workers),
                         interceptors=interceptors, options=options)
    _add_service(server, service)
    bound = server.add_insecure_port(listen)
    if bound == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, service, bound


def serve(args) -> None:
    """`python -m slimen_torch serve`: listen, load the model, serve until SIGTERM/SIGINT."""
    import signal

    from . import dist
    from .engine import Engine, Options

    rank, local_rank, size = dist.world()
    if size > 1:
        args.device = dist.rank_device(args.device, local_rank)
        dist.die_with_parent()
    if rank != 0:
        # A follower of a worker group (torchrun): rank 0 serves; this rank runs its calls.
        dist.serve_rank(args, _options(args), None, on_fault=_device_fault_exit)
        return
    token = ""
    if args.token_env:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise SystemExit(f"--token-env {args.token_env}: the variable is empty or unset")
    listen = args.listen
    if size > 1:
        listen = dist.relisten(listen, args.address_file)
    try:
        server, service, port = make_server(listen, token, roots=args.root)
    except ValueError as e:
        raise SystemExit(f"slimen_torch serve: {e}") from None
    host = args.listen.rpartition(":")[0]
    if host in ("0.0.0.0", "[::]", "::"):
        # Every interface: the address others reach it at is this machine's name (a worker group
        # on a cluster writes it for the host to find, docs/cluster.md).
        import socket
        host = socket.gethostname()
    addr = f"{host}:{port}"
    log.info("listening on %s (loading %s); clients save and load model folders only under %s",
             addr, args.model, ", ".join(service.roots.dirs))
    if args.address_file:
        tmp = args.address_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(addr + "\n")
        os.replace(tmp, args.address_file)  # readers never see half a line
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    opts = _options(args)
    try:
        if size > 1:
            service.engine = dist.serve_rank(args, opts, service, on_fault=_device_fault_exit)
            log.info("serving %s on %s from %d ranks: %s", args.model, addr, size,
                     ", ".join(service.engine.devices))
        else:
            service.engine = Engine(args.model, opts)
            service.engine.on_fault = _device_fault_exit
            log.info("serving %s on %s", args.model, addr)
    except BaseException:
        # A model that cannot load ends the worker: the server goes first, or a call that
        # comes in while the interpreter shuts down (the host's health checks) leaves gRPC's
        # threads waiting, and the process never exits.
        server.stop(grace=None).wait()
        raise
    service.loading = False
    stop.wait()
    service.loading = True
    shut_down(server, service.engine, size)


# The exit status of a worker whose device failed (engine.device_fault): the host's supervisor
# starts a new one, as after any exit.
DEVICE_FAULT_EXIT = 75


def _device_fault_exit(reason: str) -> None:
    """Engine.on_fault of a served engine: the device's failure ends the process at once. Its
    CUDA context runs nothing more, and the calls in flight are better resent by the host to the
    worker it starts next (it puts the policy's state back first) than failed."""
    log.error("the device failed (%s): exiting, for the host to start a new worker", reason)
    exit_now(DEVICE_FAULT_EXIT)


def shut_down(server, engine, size: int) -> None:
    """The end of serve: the server stops (its calls in flight get a few seconds), then the
    engine. A group's rank 0 whose follower is gone already (its link broke: torchrun stops the
    group because that rank died, or every rank at the end of a run) waits for neither: the
    follower's requests never finish and the group cannot close, and torchrun starts the group
    again only once every rank has exited."""
    if size > 1:
        engine.stopping()  # the followers are stopping too: their links may break now
        if engine.lost:
            log.info("rank %s gone: exiting at once", ", ".join(map(str, engine.lost)))
            server.stop(grace=None)
            exit_now(0)
    server.stop(grace=5).wait()
    if size == 1:
        engine.close()
        # Every call has ended and the engine is closed: what is left is the interpreter's
        # finalization of torch, Triton and gRPC, which takes seconds (5 s on a busy 2-core
        # machine) while the host waits for the process, at the end of every run.
        exit_now(0)
    # torchrun stops every rank of the group at once: the followers may be gone already, and a
    # collective with a rank that left never returns, so the group gets a few seconds.
    if engine.close(timeout=5):
        import torch.distributed
        torch.distributed.destroy_process_group()
    else:
        log.info("the other ranks have stopped; exiting")
        exit_now(0)


def _options(args):
    from .engine import Options

    return Options(device=args.device, dtype=args.dtype, slots=args.slots,
                   max_seq_len=args.max_seq_len, cuda_graphs=not args.no_cuda_graphs,
                   compile=not args.no_compile, compile_train=args.compile_train,
                   kernels=False if args.no_kernels else None,
                   fused_b1=False if args.no_fused_b1 else None,
                   fused_head=not args.no_fused_head,
                   prefill_graph_max=args.prefill_graph_max,
                   compile_prefill=getattr(args, "compile_prefill", True),
                   shared_prompts=getattr(args, "shared_prompts", True),
                   prefix_cache=args.prefix_cache, prefix_min=args.prefix_min,
                   kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                   micro_batch_tokens=args.micro_batch_tokens,
                   grad_checkpointing=args.grad_checkpointing, ref_model=args.ref_model,
                   versions=not getattr(args, "no_versions", False),
                   push=not getattr(args, "no_push", False),
                   deterministic=getattr(args, "deterministic", False))
