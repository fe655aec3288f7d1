"""The agent's MQTT session: wait for a task, fetch the model, train, publish.

paho's network thread only decodes and queues; training runs on the main
thread so the session keeps answering keepalives while the CPU is busy. The
device's status (retained, with a will for "offline") carries its hardware
profile and whether it is busy training.

The agent holds its parts: the model arrives as described in `model_fetch`
(full, cached, or as sha256-checked deltas); the device's data comes from its
source (`data_sources`) and is checked against the model before training; a
task may also ask it to evaluate the received model on its held-out slice.
The round itself is `device_step` (the same function the in-memory benchmarks
run): the update (the model delta) goes out signed with the device's key, in
the codec the task names; for top-k codecs the error-feedback residual is kept
in the device state (saved once per round with the rest).

A broker's acknowledgement is not delivery: the agent resends its update
until the coordinator's receipt for that round and attempt arrives, or the
deadline passes, and logs the verdict either way (`delivery`). The receipt
says what the fold made of the update (folded, clipped, left out, or pending
with a second receipt to come), and the device commits its algorithm state and
residual only for what was folded, as it was folded (`settlement`); an update
still without a verdict is resent before the next training task. A task it will not run
(settings out of range, a model that does not fit) gets a signed refusal
with the reason, so the coordinator can say why a round found no quorum.

The owner's conditions (`conditions`: hours, load, temperature, CPU-seconds a day) decide whether
the device may train now; its status says so (`eligible`, `why`), checked again while idle and
republished only when the answer changes, and a task that arrives while it may not train is
refused with the reason. A training that has started is finished.

Once per model version the agent offers the verified release to the device's serving store through
the local gate (`serving_gate`), after the round's answer is out (a copy taken before training); a
store that cannot be written is logged and counted, and never stops training.
"""

from __future__ import annotations

import copy
import logging
import queue
import signal
import threading
import time
from pathlib import Path

import torch

from edgefl_protocol import OLDEST_SCHEMA, algorithms, codec, downlink, messages, protocol, signing, topics
from edgefl_protocol.algorithms.base import EXTRA_PREFIX
from edgefl_protocol.errors import Rejected
from edgefl_protocol.transport import Session
from edgefl_protocol.version import software
from edgefl_models.architectures import get_weights, resolve, set_weights
from edgefl_models.datasets import DatasetError
from edgefl_models.objectives import Objective, format_score

from .conditions import Conditions, Reason
from .config import AgentConfig
from .data_sources import DataSource, LocalData, check_fits, open_source
from .delivery import Delivery
from .device_step import Budget, agent_seed, device_step, local_settings
from .hardware import calibrate, default_threads, probe
from .installed_model import installed_model
from .model_fetch import MAX_MODEL_VALUES, ModelFetch
from .runtime import record_session
from .serving_fetch import ServingFetch
from .serving_gate import ServingGate
from .settlement import Settlement
from .state import DeviceState
from .training import Stopped
from .upgrade import UpgradeRequired

log = logging.getLogger("edge_agent")
SPEED_SMOOTHING = 0.5  # weight of the newest measured throughput in the running estimate
CONDITIONS_EVERY = 10.0  # seconds between checks of the owner's conditions while idle


class Agent:
    """One device's service. Its parts: `fetch` (the model versions), `delivery` (answers and their
    receipts), `settlement` (what the device commits of what it sent)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.fed, self.device = config.device.federation, config.device.id
        self.sources: dict[str, DataSource] = {}  # task kind -> the local data source, opened at the first task
        if config.data.source != "spool" and not Path(config.data.path).exists():  # a spool may come later
            raise DatasetError(f"local data file {config.data.path} does not exist (set [data] path)")
        self.tasks: queue.Queue[messages.Task] = queue.Queue(maxsize=16)
        self.key = signing.key_from_hex(config.device.signing_key) if config.device.signing_key else None
        if self.key is None:
            log.error("no signing_key in [device]: the coordinator will reject every update from %s", self.device)
        self.stopping = threading.Event()
        self.handled: list[tuple[int, int]] = []  # recent (round, attempt) tasks: a task delivered twice runs once
        self.busy = False
        self.released: dict = {}  # extra.* tensors of the current model release
        self.state = DeviceState(config.device.state_dir)
        self.state.data["identity"] = {"device": self.device, "federation": self.fed}
        self.fetch = ModelFetch(self.fed, self.state, Path(config.device.state_dir), self.stopping)
        threads = config.device.threads or default_threads()
        torch.set_num_threads(threads)
        # samples: as of the last round; the software: so that the operator sees the fleet's versions
        self.profile = {**probe(), **software(), "torch": torch.__version__, "threads": threads, "samples": 0}
        self.conditions = Conditions(config.conditions, config.device.state_dir)
        self.not_eligible: Reason | None = self.conditions.check()  # replaced whole: the network thread reads it
        self._next_check = time.monotonic() + CONDITIONS_EVERY
        if self.conditions.enabled:
            log.info("the owner's conditions: %s%s", self.conditions.describe(),
                     f"; may not train now: {self.not_eligible}" if self.not_eligible else "")
        b = config.broker
        self.session = Session(self.device, b.username, b.password, b.host, b.port, self._on_connect,
                               self._on_message, keepalive=b.keepalive,
                               will=(topics.status(self.fed, self.device), self._status("offline")),
                               tls_ca=b.tls_ca or None)
        self.delivery = Delivery(self.session.publish_until, topics.update(self.fed, self.device), self.stopping,
                                 superseded=lambda: not self.tasks.empty())
        self.settlement = Settlement(self.state, self.delivery, self.fetch.give_back_down_counts)
        self.upgrade = UpgradeRequired(self.state)
        self.serving = ServingGate(config.serving) if config.serving.dir else None  # [serving] dir = "": off
        if self.serving and (current := self.serving.store.current_version()) is not None:
            self.profile["serving_current"] = current
        self.serving_fetch = ServingFetch(self.fed, self.serving.store.current_version()) if self.serving else None
        self._judged_by: tuple[int, LocalData, Objective] | None = None  # the last task's round, data, objective

    def _status(self, state: str) -> bytes:
        profile = {**self.profile, "busy": self.busy, "last_round": int(self.state.data.get("last_round", 0))}
        why = self.not_eligible
        profile["eligible"] = why is None  # the coordinator selects only eligible devices (presence.py)
        if why is not None:
            profile["why"] = why.text
        return messages.encode("status", messages.Status(self.device, state, profile), OLDEST_SCHEMA)

    def _announce(self) -> None:
        self.session.publish(topics.status(self.fed, self.device), self._status("online"), retain=True)

    def _recheck(self, announce: bool = True) -> Reason | None:
        """The owner's conditions now; a change of whether (and by which condition) the device may
        not train is logged and, with `announce`, published. Readings that move within the same
        condition are not: the broker hears of changes only."""
        reason = self.conditions.check()
        before = self.not_eligible
        self.not_eligible = reason
        if (before and before.condition) != (reason and reason.condition):
            if reason:
                log.info("may not train now: %s", reason)
            else:
                log.info("may train again: the owner's conditions are met")
            if announce:
                self._announce()
        return reason

    def _idle_tick(self) -> None:
        self.upgrade.keep()
        if self.conditions.enabled and time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + CONDITIONS_EVERY
            self._recheck()

    # paho callbacks (network thread) -------------------------------------------------
    def _on_connect(self, client) -> None:  # noqa: ANN001
        client.subscribe([(topics.task(self.fed, self.device), 1), (topics.models(self.fed), 1),
                          (topics.receipt(self.fed, self.device), 1)] + self.fetch.subscriptions()
                         + (self.serving_fetch.subscriptions() if self.serving_fetch else []))
        client.publish(topics.status(self.fed, self.device), self._status("online"), qos=1, retain=True)
        record_session(client, self.config.device.state_dir)  # for `edge-agent status` (edge_agent/runtime.py)
        log.info("connected as %s", self.device)

    def _on_message(self, client, msg) -> None:  # noqa: ANN001
        try:
            if msg.topic == topics.task(self.fed, self.device):  # from protocol 2 on, signed with our key
                self.tasks.put_nowait(messages.decode_task(protocol.unseal(msg.payload, self.key)))
                self.delivery.wake()  # a delivery still waiting for its receipt is superseded
            elif msg.topic == topics.receipt(self.fed, self.device):
                payload = protocol.unseal(msg.payload, self.key)
                if protocol.header(payload).get("kind") == "upgrade":
                    self.upgrade.notice(protocol.decode_upgrade(payload))
                else:
                    self.delivery.receive(messages.decode_receipt(payload))
            elif self.serving_fetch is not None and self.serving_fetch.owns(msg.topic):
                self.serving_fetch.on_message(client, msg.topic, msg.payload)
            else:  # model manifests, chunks and deltas
                self.fetch.on_message(client, msg.topic, msg.payload)
        except Rejected as exc:
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
                    self._idle_tick()
                    self._serve_release()
                    continue
                self._handle(task)
                self._serve_release()
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
        self.upgrade.served(task.protocol)
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
        if self.conditions.enabled and (reason := self._recheck()) is not None:
            # selected before its status said so (or by a coordinator of the previous release): not an error
            log.info("round %d: refusing the task: %s", task.round, reason)
            self._refuse(task, Rejected("ineligible", reason.text))
            return
        got = self.fetch.wait_for_model(task.model_version, task.deadline)
        if got is None:
            log.warning("round %d: model version %d never arrived; skipped", task.round, task.model_version)
            return
        release, body = got
        try:  # what the step will need, checked before anything is spent: a task it cannot run is refused
            algorithms.get(task.algorithm)
            objective = Objective.of(task.task, task.loss)
            model = installed_model(release)
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
        self.fetch.remember_model(release, body)
        self._judged_by = (task.round, data, objective)
        # a coordinator without serving releases: the version it trains from is served, once the round's
        # answer is out (writing model.onnx takes seconds on a Pi Zero, and the deadline is the round's)
        serve = copy.deepcopy(model) if self.serving and not (self.serving_fetch and self.serving_fetch.seen) \
            and self.serving.wants(release.version) else None
        try:
            evaluation = self._evaluate(task, model, data, objective)
            if not task.train:
                self._report(task, evaluation)
                return
            self._train_and_send(task, release, model, data, evaluation)
        except Rejected as exc:
            log.error("round %d: task rejected: %s", task.round, exc)
            self._refuse(task, exc)
        except Exception:  # a bug or a hostile task must not take the device's service down
            log.exception("round %d: task failed; waiting for the next one", task.round)
        finally:
            if serve is not None:
                self._serve(task.round, release, serve, data, objective)

    def _serve_release(self) -> None:
        """The coordinator's serving release, once it is whole, through the gate: judged on the data
        and objective of the last task (it waits for the first task)."""
        if self.serving_fetch is None or self._judged_by is None or (ready := self.serving_fetch.take()) is None:
            return
        release, body = ready
        round_no, data, objective = self._judged_by
        self.state.data["serving_downlink"] = self.serving_fetch.counts()  # bytes and releases, full or delta
        try:
            model = installed_model(release)
            set_weights(model, downlink.decode_weights(release, body, None, MAX_MODEL_VALUES))
        except (Rejected, ValueError, KeyError) as exc:
            log.warning("serving release %d refused: %s; the current version keeps serving", release.version, exc)
            return
        self._serve(round_no, release, model, data, objective)

    def _serve(self, round_no: int, release: messages.ModelRelease, model: torch.nn.Module,
               data: LocalData, objective: Objective) -> None:
        """Offer a new version to the serving store (once per version; `model` as released, not trained)."""
        if self.serving is None or not self.serving.wants(release.version):
            return
        try:
            decision = self.serving.offer(release, round_no, model, data.held_out, objective, data.train)
        except Exception as exc:  # the store is for the device's applications: never stop training for it
            self.serving.errors += 1
            self.profile["serving_errors"] = self.serving.errors
            log.warning("round %d: cannot publish model version %d to the serving store %s: %s; check that the "
                        "directory exists, is writable by the agent and has space ([serving] dir, \"\" = off); "
                        "applications keep the current version", round_no, release.version,
                        self.serving.store.root, exc)
            return
        finally:
            model.train()
        log.info("round %d: serving: %s", round_no, decision.text())
        current = self.serving.store.current_version()
        if current is not None:
            self.profile["serving_current"] = current
        self.profile["serving_decision"] = decision.text()[:200]

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
        self.delivery.deliver(task, messages.encode_report(report, self.key or b"", task.protocol), "evaluation report")

    def _another_task(self, task: messages.Task, release: messages.ModelRelease) -> None:
        """A federation's new task (another network, or another algorithm): what this device kept for
        the old one, its algorithm's state and what top-k still owed, means nothing for the new one."""
        trains = f"{release.fingerprint}/{task.algorithm}"
        before = self.state.data.get("trains")
        self.state.data["trains"] = trains
        if before is None or before == trains:  # an agent of an earlier release kept no record: keep its state
            return
        dropped = sorted(k for k in self.state.data if k in algorithms.ALGORITHMS or k == "codec")
        for key in dropped:
            del self.state.data[key]
        self.settlement.unsettled = self.settlement.committed = None
        self.state.save()
        log.info("round %d: the federation trains another model or algorithm (%s %s) than this device did: "
                 "its state for the old one starts afresh (%s)", task.round, release.arch, task.algorithm,
                 ", ".join(dropped) or "nothing kept")

    def _train_and_send(self, task: messages.Task, release: messages.ModelRelease, model: torch.nn.Module,
                        data: LocalData, evaluation: dict) -> None:
        self._another_task(task, release)
        self.settlement.settle_unsettled(task)  # an earlier update without a verdict: asked for before training
        down = self.fetch.take_down_counts()  # reported once: given back if the update is not accepted
        # which model this trained from, and how it arrived (the server's sha256 prefix of the same bytes)
        report = {**evaluation, "model_sha": release.sha256[:16],
                  "model_via": self.fetch.arrived_via.get(release.version, "cache"),  # and what it serves, why:
                  **{k: self.profile[k] for k in ("serving_current", "serving_decision") if k in self.profile}}
        self.busy = True
        self._announce()
        try:
            with self.conditions.training():  # its CPU-seconds count against the owner's daily cap
                step = device_step(task, model, data.train, self.state.data, device=self.device,
                                   federation=self.fed, key=self.key or b"", seed=agent_seed(self.device, task.round),
                                   budget=Budget(lambda: self._speed(release.arch, model),
                                                 task.deadline - time.time()),
                                   released=self.released, report=report, down=down,
                                   should_stop=self.stopping.is_set)
        except Stopped:
            self.fetch.give_back_down_counts(down)
            log.info("round %d: stopped mid-training by shutdown; no update sent", task.round)
            return
        finally:
            self.busy = False
        result = step.result
        if "dp_epsilon" in result.metrics:  # the device's own epsilon, in its status too
            self.profile["dp_epsilon"] = result.metrics["dp_epsilon"]
        speeds = self.state.data.setdefault("samples_per_s", {})
        measured = result.num_samples * step.epochs / max(float(result.metrics["train_seconds"]), 1e-6)
        speeds[release.arch] = (1 - SPEED_SMOOTHING) * speeds.get(release.arch, measured) + SPEED_SMOOTHING * measured
        self.state.data["last_round"] = task.round
        self.state.data["last_model_version"] = task.model_version
        if self.conditions.enabled:
            self._recheck(announce=False)  # e.g. the daily cap reached: the status below says so
        self._announce()  # idle before the update goes out, so the next round can select us at once
        log.info("round %d: trained (%d samples, %d epochs: %s, loss %.4f, %.2f s)", task.round,
                 result.num_samples, step.epochs, step.epochs_reason, result.metrics["train_loss"],
                 result.metrics["train_seconds"])
        outcome = self.delivery.deliver(task, step.sent.payload, "update")
        # state the server mirrors follows what it folded: the decoded delta, at the fold's scale
        receipt = (self.delivery.last_receipt if outcome != "unsent" else  # never reached the broker
                   messages.Receipt(task.round, task.attempt, False, "unsent", "not delivered"))
        self.settlement.settle(step.sent, receipt)
        self.state.save()  # once per round: algorithm state, residuals, progress

    def _refuse(self, task: messages.Task, why: Rejected) -> None:
        refusal = messages.Refusal(self.device, task.round, task.attempt, why.reason, why.detail[:200], self.fed)
        self.delivery.deliver(task, messages.encode_refusal(refusal, self.key or b"", task.protocol), "refusal")
