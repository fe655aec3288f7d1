"""The agent's MQTT session: wait for a task, fetch the model, train, publish.

paho's network thread only decodes and queues; training runs on the main
thread so the session keeps answering keepalives while the CPU is busy. The
device's status (retained, with a will for "offline") carries its hardware
profile and whether it is busy training.

The model arrives as described in `model_fetch` (full, cached, or as
sha256-checked deltas); the device's data comes from its source
(`data_sources`) and is checked against the model before training; a task
may also ask it to evaluate the received model on its held-out slice.
The update (the model delta) goes out signed with the device's key, in the
codec the task names; for top-k codecs the error-feedback residual is kept in
the device state (saved once per round with the rest).

A broker's acknowledgement is not delivery: the agent resends its update
until the coordinator's receipt for that round and attempt arrives, or the
deadline passes, and logs the verdict either way. The receipt says what the
fold made of the update (folded, clipped, left out, or pending with a second
receipt to come), and the device commits its algorithm state and residual only
for what was folded, as it was folded (`settlement`); an update still without
a verdict is resent before the next training task. A task it will not run
(settings out of range, a model that does not fit) gets a signed refusal
with the reason, so the coordinator can say why a round found no quorum.
"""

from __future__ import annotations

import copy
import logging
import queue
import signal
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import torch

from edgefl_protocol import algorithms, codec, delta_downlink, downlink, messages, signing, topics
from edgefl_protocol.algorithms.base import EXTRA_PREFIX
from edgefl_protocol.errors import Rejected
from edgefl_protocol.task_limits import check_training
from edgefl_protocol.transport import Session
from models.architectures import ModelError, build_model, fingerprint, get_weights, resolve, set_weights
from models.datasets import DatasetError
from models.objectives import Objective, format_score

from . import dp_sgd
from .config import AgentConfig
from .data_sources import DataSource, LocalData, check_fits, open_source
from .hardware import calibrate, default_threads, plan_epochs, probe
from .model_fetch import DOWN_COUNTERS, MAX_MODEL_BYTES, MAX_MODEL_VALUES, ModelFetch
from .runtime import record_session
from .settlement import SETTLE_WAIT, Settlement, describe, owed  # noqa: F401 (owed is imported from here)
from .state import DeviceState
from .training import LocalSettings, Stopped, train_locally

log = logging.getLogger("edge_agent")
SPEED_SMOOTHING = 0.5  # weight of the newest measured throughput in the running estimate
RESEND_AFTER = 10.0  # seconds without a receipt before the update goes out again


def local_settings(hp: dict) -> LocalSettings:
    """The task's training settings, range-checked (edgefl_protocol.task_limits): a hostile task is
    refused, not obeyed."""
    v = check_training(hp)
    dp = dp_sgd.from_task(hp)
    if dp is not None and (why := dp_sgd.unavailable()):
        raise Rejected(dp_sgd.UNAVAILABLE, why)
    return LocalSettings(epochs=int(v["local_epochs"]), batch_size=int(v["batch_size"]), lr=v["lr"],
                         momentum=v["momentum"], weight_decay=v["weight_decay"], grad_clip=v["grad_clip"], dp=dp)


class Agent(ModelFetch, Settlement):
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.fed, self.device = config.device.federation, config.device.id
        self.sources: dict[str, DataSource] = {}  # task kind -> the local data source, opened at the first task
        if config.data.source != "spool" and not Path(config.data.path).exists():  # a spool may come later
            raise DatasetError(f"local data file {config.data.path} does not exist (set [data] path)")
        self.tasks: queue.Queue[messages.Task] = queue.Queue(maxsize=16)
        self.models: dict[int, tuple[messages.ModelRelease, bytes]] = {}  # version -> manifest, verified body
        self.assemblies: dict[int, downlink.Assembly] = {}  # versions being fetched
        self.chains: dict[int, delta_downlink.Chain] = {}  # versions being reconstructed from deltas
        self.downlink_rejected: Counter[str] = Counter()  # model messages ignored, by reason
        self.arrived_via: dict[int, str] = {}  # version -> how the model got here: cache, full or delta
        self.cached: tuple[str, bytes] | None = self._load_cached_model()  # (sha256, body)
        self.models_changed = threading.Condition()
        self.key = signing.key_from_hex(config.device.signing_key) if config.device.signing_key else None
        if self.key is None:
            log.error("no signing_key in [device]: the coordinator will reject every update from %s", self.device)
        self.stopping = threading.Event()
        self.receipts: dict[tuple[int, int], messages.Receipt] = {}  # (round, attempt) -> the coordinator's verdict
        self.receipt_arrived = threading.Condition()
        self.handled: list[tuple[int, int]] = []  # recent (round, attempt) tasks: a task delivered twice runs once
        self.busy = False
        self.released: dict = {}  # extra.* tensors of the current model release
        self.state = DeviceState(config.device.state_dir)
        self.state.data["identity"] = {"device": self.device, "federation": self.fed}
        # model bytes received (manifests, chunks, deltas) not yet reported with an accepted update;
        # "_join": received while the device held no model at all (its first download)
        for key in DOWN_COUNTERS:
            self.state.data.setdefault(key, 0)
        threads = config.device.threads or default_threads()
        torch.set_num_threads(threads)
        self.profile = {**probe(), "threads": threads, "samples": 0}  # samples: as of the last round
        b = config.broker
        self.session = Session(self.device, b.username, b.password, b.host, b.port, self._on_connect,
                               self._on_message, keepalive=b.keepalive,
                               will=(topics.status(self.fed, self.device), self._status("offline")),
                               tls_ca=b.tls_ca or None)

    def _status(self, state: str) -> bytes:
        profile = {**self.profile, "busy": self.busy, "last_round": int(self.state.data.get("last_round", 0))}
        return messages.encode("status", messages.Status(self.device, state, profile))

    def _announce(self) -> None:
        self.session.publish(topics.status(self.fed, self.device), self._status("online"), retain=True)

    # paho callbacks (network thread) -------------------------------------------------
    def _on_connect(self, client) -> None:  # noqa: ANN001
        client.subscribe([(topics.task(self.fed, self.device), 1), (topics.models(self.fed), 1),
                          (topics.receipt(self.fed, self.device), 1)]
                         + [(topics.model_chunks(self.fed, v), 1) for v in list(self.assemblies)]
                         + [(topics.model_delta(self.fed, v), 1) for c in list(self.chains.values()) for v in c.versions])
        client.publish(topics.status(self.fed, self.device), self._status("online"), qos=1, retain=True)
        record_session(client, self.config.device.state_dir)  # for `edge-agent status` (edge_agent/runtime.py)
        log.info("connected as %s", self.device)

    def _on_message(self, client, msg) -> None:  # noqa: ANN001
        try:
            if msg.topic == topics.task(self.fed, self.device):
                self.tasks.put_nowait(messages.decode_task(msg.payload))
                with self.receipt_arrived:  # a delivery still waiting for its receipt is superseded
                    self.receipt_arrived.notify_all()
            elif msg.topic == topics.receipt(self.fed, self.device):
                receipt = messages.decode_receipt(msg.payload)
                with self.receipt_arrived:
                    self.receipts[(receipt.round, receipt.attempt)] = receipt
                    self.receipt_arrived.notify_all()
            elif (version := topics.parse_model_topic(msg.topic)) is not None and msg.payload:
                self._count_down(msg.payload)
                release = messages.decode_model(msg.payload, MAX_MODEL_BYTES)
                if release.version != version:
                    raise Rejected("schema", f"model topic says version {version}, message says {release.version}")
                self._on_manifest(client, release)
            elif (where := topics.parse_model_chunk_topic(msg.topic)) is not None and msg.payload:
                self._count_down(msg.payload)
                self._on_chunk(client, *where, msg.payload)
            elif (version := topics.parse_model_delta_topic(msg.topic)) is not None and msg.payload:
                self._count_down(msg.payload)
                self._on_delta(client, version, msg.payload)
        except Rejected as exc:
            if msg.topic.split("/")[2:3] == ["model"]:
                self.downlink_rejected[exc.reason] += 1
            log.warning("ignored message on %s: %s", msg.topic, exc)
        except queue.Full:
            log.warning("task queue full; dropped a task on %s", msg.topic)

    # main thread --------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        self.session.start()
        try:
            while not self.stopping.is_set():
                try:
                    task = self.tasks.get(timeout=0.5)
                except queue.Empty:
                    continue
                self._handle(task)
        finally:
            self.state.save()
            self.session.stop(last_words=(topics.status(self.fed, self.device), self._status("offline")))
        log.info("stopped")
        return 0

    def _speed(self, arch: str, model: torch.nn.Module) -> float:
        """Training samples/s for this model: calibrated once, then refined by every real round."""
        speeds = self.state.data.setdefault("samples_per_s", {})
        if arch not in speeds:
            speeds[arch] = calibrate(model, resolve(arch).input_shape)
            log.info("calibrated %s: %.0f training samples/s", arch, speeds[arch])
        return float(speeds[arch])

    def _handle(self, task: messages.Task) -> None:
        if (task.round, task.attempt) in self.handled:
            log.info("round %d (attempt %d): task delivered again; already handled", task.round, task.attempt)
            return
        self.handled = self.handled[-15:] + [(task.round, task.attempt)]
        try:
            self._work_on(task)
        finally:
            # done with this round, whatever happened: say so, so the coordinator may select us again
            if int(self.state.data.get("last_round", 0)) < task.round:
                self.state.data["last_round"] = task.round
                if not self.stopping.is_set():
                    self._announce()

    def _work_on(self, task: messages.Task) -> None:
        if time.time() > task.deadline:
            log.warning("round %d: task arrived after its deadline; skipped", task.round)
            return
        got = self._wait_for_model(task.model_version, task.deadline)
        if got is None:
            log.warning("round %d: model version %d never arrived; skipped", task.round, task.model_version)
            return
        release, body = got
        try:
            algorithm = algorithms.get(task.algorithm)
            objective = Objective.of(task.task, task.loss)
            model = self._installed_model(release)
            data = self._local_data(task, release.arch, objective)
            tensors = downlink.decode_weights(release, body, None, MAX_MODEL_VALUES)
            specs = codec.specs_of(get_weights(model))
            if any(name not in tensors or tensors[name].shape != shape for name, shape in specs.items()):
                raise Rejected("shape", f"model version {release.version} does not fit architecture {release.arch}")
            set_weights(model, tensors)
            # tensors the server rule released with the model, e.g. FedSMOO's global perturbation
            self.released = {name: a for name, a in tensors.items() if name.startswith(EXTRA_PREFIX)}
            codec.parse(task.codec)
            local_settings(task.hparams)
        except (ValueError, Rejected) as exc:
            refusal = exc if isinstance(exc, Rejected) else Rejected("task_unusable", str(exc))
            log.error("round %d: refusing the task: %s", task.round, refusal)
            self._refuse(task, refusal)
            return
        self._remember_model(release, body)
        try:
            evaluation = self._evaluate(task, model, data, objective)
            if not task.train:
                self._report(task, evaluation)
                return
            self._train_and_send(task, release, algorithm, model, data, objective, evaluation)
        except Rejected as exc:
            log.error("round %d: task rejected: %s", task.round, exc)
            self._refuse(task, exc)
        except Exception:  # a bug or a hostile task must not take the device's service down
            log.exception("round %d: task failed; waiting for the next one", task.round)

    def _installed_model(self, release: messages.ModelRelease) -> torch.nn.Module:
        """The release's model as installed here; refused (Rejected) when this machine cannot build it
        or builds a different one (another version of the user's package)."""
        try:
            model = build_model(release.arch)
        except ModelError as exc:
            raise Rejected("unknown_model", str(exc)) from None
        if release.fingerprint and fingerprint(model) != release.fingerprint:
            names = ", ".join(f"{n} {tuple(p.shape)}" for n, p in list(model.named_parameters())[:3])
            raise Rejected("model_mismatch", f"the installed {release.arch} ({names}, ...) differs from the "
                                             f"coordinator's (fingerprint {fingerprint(model)[:12]} vs "
                                             f"{release.fingerprint[:12]}): install the same version of the "
                                             "model's package here and on the coordinator")
        return model

    def _local_data(self, task: messages.Task, arch: str, objective: Objective) -> LocalData:
        """This round's local data (the spool source reads what is new), checked against the model."""
        source = self.sources.get(objective.task)
        try:
            if source is None:
                source = self.sources[objective.task] = open_source(self.config.data, objective.task)
            data = source.read()
            spec = resolve(arch)
            check_fits(data.train if len(data.train) else data.held_out, spec.input_shape, objective.task,
                       spec.num_classes, model=arch, where=self.config.data.path)
        except (DatasetError, ValueError) as exc:  # unreadable, empty, or not this model's data
            raise Rejected("data_unusable", f"{exc}") from None
        if len(data.train) == 0 and task.train:
            raise Rejected("data_unusable", f"no training samples yet ({source.describe()})")
        self.profile["samples"] = len(data.train)
        log.info("round %d: local data: %s", task.round, source.describe())  # describe() has the counts
        return data

    def _evaluate(self, task: messages.Task, model: torch.nn.Module, data: LocalData,
                  objective: Objective) -> dict[str, float | int | str]:
        """The received model's metric on the held-out slice, when the task asks (eval_* metrics)."""
        if not task.evaluate:
            return {}
        if len(data.held_out) == 0:
            if not task.train:
                raise Rejected("no_holdout", "asked to evaluate, but no local data is held out: set [data] holdout")
            log.warning("round %d: asked to evaluate, but no local data is held out ([data] holdout = 0)", task.round)
            return {}
        result = objective.evaluate(model, data.held_out)
        model.train()
        log.info("round %d: model version %d on %d held-out samples: %s %s", task.round, task.model_version,
                 result.count, result.metric, format_score(result.metric, result.score))
        return {"eval_metric": result.metric, "eval_score": result.score, "eval_loss": result.loss,
                "eval_count": result.count}

    def _report(self, task: messages.Task, evaluation: dict) -> None:
        report = messages.EvalReport(self.device, task.round, task.attempt, task.model_version,
                                     str(evaluation["eval_metric"]), float(evaluation["eval_score"]),
                                     float(evaluation["eval_loss"]), int(evaluation["eval_count"]), self.fed)
        self._deliver(task, messages.encode_report(report, self.key or b""), "evaluation report")

    def _train_and_send(self, task: messages.Task, release: messages.ModelRelease,
                        algorithm: algorithms.Algorithm, model: torch.nn.Module, data: LocalData,
                        objective: Objective, evaluation: dict) -> None:
        hp = task.hparams
        settings = local_settings(hp)
        epochs, epochs_reason = settings.epochs, "fixed by the coordinator"
        if epochs == 0:
            rule_state = self.state.section(algorithm.name)
            plan = plan_epochs(self._speed(release.arch, model), len(data.train), task.deadline - time.time(),
                               tau=float(rule_state.get("tau", 0.0)),
                               passes_per_step=float(hp.get("passes_per_step", 1.0)))
            epochs, epochs_reason = plan.epochs, plan.reason
        settings.epochs = epochs
        self._settle_unsettled(task)  # an earlier update without a verdict: asked for before training
        before = copy.deepcopy(self.state.section(algorithm.name))  # restored unless the update is folded
        rule = algorithm.client(hp, task.broadcast, self.state.section(algorithm.name), self.released)
        seed = zlib.crc32(f"{self.device}/{task.round}".encode())
        self.busy = True
        self._announce()
        try:
            result = train_locally(model, data.train, rule, settings, seed, should_stop=self.stopping.is_set,
                                   objective=objective)
        except Stopped:
            log.warning("round %d: stopped mid-training by shutdown; no update sent", task.round)
            return
        finally:
            self.busy = False
        result.metrics["epochs_reason"] = epochs_reason
        if settings.dp:  # the device's own epsilon, in its update and its status
            ledger = self.state.data.setdefault("dp_sgd", [])
            self.profile["dp_epsilon"] = result.metrics["dp_epsilon"] = dp_sgd.spend(
                ledger, settings.dp, float(result.metrics["dp_sample_rate"]), int(result.metrics["steps"]))
        result.metrics.update(evaluation)
        speeds = self.state.data.setdefault("samples_per_s", {})
        measured = result.num_samples * epochs / max(float(result.metrics["train_seconds"]), 1e-6)
        speeds[release.arch] = (1 - SPEED_SMOOTHING) * speeds.get(release.arch, measured) + SPEED_SMOOTHING * measured
        ef = self.state.section("codec")  # error feedback: what top-k has not sent yet
        down = self._take_down_counts()  # reported once: given back below if the update is not accepted
        result.metrics.update(down)
        # which model this trained from, and how it arrived (the server's sha256 prefix of the same bytes)
        result.metrics["model_sha"] = release.sha256[:16]
        result.metrics["model_via"] = self.arrived_via.get(release.version, "cache")
        result.metrics.update(self._claims())  # earlier updates its residual still owes (never folded)
        old_residual = ef.get("residual")
        encoded = codec.encode(result.delta, task.codec, old_residual)
        update = messages.Update(self.device, task.round, task.model_version, result.num_samples, result.metrics,
                                 encoded.body, encoded.codec, encoded.specs, self.fed, task.attempt)
        self.state.data["last_round"] = task.round
        self.state.data["last_model_version"] = task.model_version
        self._announce()  # idle before the update goes out, so the next round can select us at once
        log.info("round %d: trained (%d samples, %d epochs: %s, loss %.4f, %.2f s)", task.round,
                 result.num_samples, epochs, epochs_reason, result.metrics["train_loss"],
                 result.metrics["train_seconds"])
        payload = messages.encode_update(update, self.key or b"")
        sent = self._sent(task, payload, algorithm.name, rule, before, result.delta, encoded, old_residual, down)
        outcome = self._deliver(task, payload, "update")
        # state the server mirrors follows what it folded: the decoded delta, at the fold's scale
        self._settle(sent, self.last_receipt if outcome != "unsent" else  # never reached the broker
                     messages.Receipt(task.round, task.attempt, False, "unsent", "not delivered"))
        self.state.save()  # once per round: algorithm state, residuals, progress

    def _refuse(self, task: messages.Task, why: Rejected) -> None:
        refusal = messages.Refusal(self.device, task.round, task.attempt, why.reason, why.detail[:200], self.fed)
        self._deliver(task, messages.encode_refusal(refusal, self.key or b""), "refusal")

    def _deliver(self, task: messages.Task, payload: bytes, what: str) -> str:
        """Publish, then wait for the coordinator's receipt; resend while none comes, until the deadline.
        The log says what became of it, either way; so does the result: accepted, rejected, pending
        (accepted, the fold's final verdict not yet known), superseded (a newer task came first),
        no_receipt, or unsent; `last_receipt` is the receipt it settled on, if any."""
        key = (task.round, task.attempt)
        topic = topics.update(self.fed, self.device)
        sends, self.last_receipt = 0, None
        while time.time() < task.deadline and not self.stopping.is_set():
            if not self.session.publish_until(topic, payload, task.deadline):
                break
            sends += 1
            resend_at = min(time.time() + RESEND_AFTER, task.deadline)
            with self.receipt_arrived:
                # short waits: a SIGTERM sets `stopping` without notifying anyone
                while not (key in self.receipts or self.stopping.is_set() or not self.tasks.empty()
                           or time.time() >= resend_at):
                    self.receipt_arrived.wait(min(0.5, max(0.0, resend_at - time.time())))
                receipt = self.receipts.pop(key, None)
                self.receipts = {k: r for k, r in self.receipts.items() if k[0] >= task.round - 2}
            if receipt is None and not self.tasks.empty():
                log.warning("round %d: a new task arrived before the receipt for the %s (sent %d times); "
                            "the coordinator moved on without it", task.round, what, sends)
                return "superseded"
            if receipt is None:
                log.info("round %d: no receipt for the %s yet; sending it again", task.round, what)
                continue
            if receipt.accepted and receipt.verdict == "pending":
                log.info("round %d: %s accepted by the coordinator%s", task.round, what, describe(receipt))
                receipt = self._await_final(key, task.deadline + SETTLE_WAIT) or receipt
            self.last_receipt = receipt
            if receipt.accepted:
                log.log(logging.INFO if receipt.verdict != "left_out" else logging.WARNING,
                        "round %d: %s accepted by the coordinator%s%s", task.round, what, describe(receipt),
                        f" (sent {sends} times)" if sends > 1 else "")
                return "pending" if receipt.verdict == "pending" else "accepted"
            log.warning("round %d: %s rejected by the coordinator: %s: %s", task.round, what,
                        receipt.reason, receipt.detail)
            return "rejected"
        if self.stopping.is_set():
            log.warning("round %d: shutting down before the coordinator's receipt for the %s (sent %d times)",
                        task.round, what, sends)
            return "no_receipt"
        if sends == 0:
            log.warning("round %d: %s not delivered to the broker before the deadline; dropped", task.round, what)
            return "unsent"
        log.warning("round %d: no receipt for the %s before the deadline (sent %d times); the coordinator may "
                    "not have it", task.round, what, sends)
        return "no_receipt"
