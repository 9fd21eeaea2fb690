// The job commands of `pith` (submit, status, watch, cancel, checkpoint, experts,
// cluster): each a few calls of the SDK (client.h) and their printing.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/cli_commands.h"
#include "common/file.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/status.h"

namespace pith::cli {

namespace {

std::string JobLine(const v1::Job& j) {
  // Before its first training step commits a job has no figures to show (not zeros).
  const std::string figures =
      j.committed_step() >= 1
          ? absl::StrFormat("loss %.4f  %.0f tokens/s  cache hit %.2f", j.last_loss(),
                            j.tokens_per_second(), j.cache_hit_rate())
          : "no step trained yet";
  // A job running on fewer workers than it asks (one died and no other was free) says so.
  const int want = std::max(1, j.spec().cluster().workers());
  const std::string short_of =
      j.state() == v1::JOB_STATE_RUNNING && j.workers() > 0 && j.workers() < want
          ? absl::StrFormat("  (%d of %d workers)", j.workers(), want)
          : "";
  return absl::StrFormat("%-24s %-10s step %d/%d  %s%s%s", j.job_id(), StateName(j.state()),
                         std::max<int64_t>(0, j.committed_step()), j.spec().train().steps(),
                         figures, short_of,
                         j.failure_reason().empty()
                             ? (j.pending_reason().empty() ? "" : "  (" + j.pending_reason() + ")")
                             : "  (" + j.failure_reason() + ")");
}

// A usage error for the first argument of `args` that looks like a flag and is not one of
// `known`: a mistyped flag is not taken for a job id or a file.
absl::Status RefuseUnknownFlags(const char* command, const Args& args,
                                std::initializer_list<absl::string_view> known = {}) {
  for (const std::string& a : args) {
    if (a.size() < 2 || a[0] != '-') continue;
    if (std::find(known.begin(), known.end(), a) == known.end()) {
      return UsageError(absl::StrCat(command, ": unknown flag ", a, " (pith help lists them)"));
    }
  }
  return absl::OkStatus();
}

// A note on stderr when fewer stores are alive than the copies `spec` asks of each group:
// the job keeps one per store until more join (pith cluster counts the copies missing).
// Nothing when the cluster cannot be read (the submit stands).
void NoteStoreCopies(Client& client, const v1::JobSpec& spec) {
  const int want = spec.cluster().store_replicas();
  if (want <= 1) return;
  absl::StatusOr<v1::ClusterStatusResponse> c = client.ClusterStatus();
  if (!c.ok()) return;
  const int alive = static_cast<int>(
      std::count_if(c->stores().begin(), c->stores().end(),
                    [](const v1::MemberInfo& m) { return m.state() == v1::MEMBER_STATE_ALIVE; }));
  if (alive >= want || alive == 0) return;  // with none, the job waits for one (pith status)
  std::cerr << "pith: note: the spec asks " << want << " store copies of each group and " << alive
            << (alive == 1 ? " store is" : " stores are")
            << " alive: the job keeps one copy per store until more join\n";
}

}  // namespace

absl::Status Submit(const CliContext& ctx, const Args& args, std::ostream& out) {
  RETURN_IF_ERROR(RefuseUnknownFlags("submit", args));
  if (args.size() != 1) return UsageError("submit takes one spec file: pith submit SPEC.json");
  ASSIGN_OR_RETURN(v1::JobSpec spec, LoadJobSpec(args[0]));
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  ASSIGN_OR_RETURN(v1::Job job, client->Submit(spec));
  NoteStoreCopies(*client, spec);
  if (ctx.json) {
    out << "{\"job_id\": \"" << job.job_id() << "\"}\n";
  } else {
    out << job.job_id() << "\n";
  }
  return absl::OkStatus();
}

absl::Status Status(const CliContext& ctx, const Args& args, std::ostream& out) {
  RETURN_IF_ERROR(RefuseUnknownFlags("status", args));
  if (args.size() > 1) return UsageError("status takes at most one job id");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  if (args.size() == 1) {
    ASSIGN_OR_RETURN(v1::Job job, client->Get(args[0]));
    out << (ctx.json ? Json(job) : JobLine(job)) << "\n";
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, client->List());
  if (ctx.json) {
    v1::ListJobsResponse all;
    for (v1::Job& j : jobs) *all.add_jobs() = std::move(j);
    out << Json(all) << "\n";
    return absl::OkStatus();
  }
  if (jobs.empty()) out << "no jobs\n";
  for (const v1::Job& j : jobs) out << JobLine(j) << "\n";
  return absl::OkStatus();
}

absl::Status Watch(const CliContext& ctx, const Args& args, std::ostream& out) {
  RETURN_IF_ERROR(RefuseUnknownFlags("watch", args));
  if (args.size() != 1) return UsageError("watch takes one job id: pith watch JOB");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  ASSIGN_OR_RETURN(v1::Job job, client->Get(args[0]));
  const int64_t steps = job.spec().train().steps();
  double first_loss = -1, last_loss = 0, tokens_per_second = 0, hit_rate = 0;
  double step_seconds = 0;  // the ETA's: the steps' times smoothed over the watch
  int64_t last_step = -2, first_step = 0;
  v1::JobEvent last;
  RETURN_IF_ERROR(client->Watch(args[0], [&](const v1::JobEvent& e) {
    // A running job's event without a new step: news only when its note changed (it
    // waits for a store that died, or no longer does).
    const bool same_step = e.step() == last_step && e.state() == v1::JOB_STATE_RUNNING;
    const bool news = e.message() != last.message();
    last = e;
    if (same_step && !news) return true;
    if (same_step) {
      if (ctx.json) {
        out << Json(e) << "\n";
      } else if (!e.message().empty()) {
        out << "job " << e.job_id() << ": " << e.message() << "\n";
      }
      out.flush();
      return true;
    }
    last_step = e.step();
    if (e.step() >= 1) {
      if (first_loss < 0) first_loss = e.loss(), first_step = e.step();
      last_loss = e.loss();
      tokens_per_second = e.tokens_per_second();
      hit_rate = e.cache_hit_rate();
      // One step's time swings (commits, placement epochs, a slow store): the ETA follows
      // their moving average, not the last one alone.
      step_seconds =
          step_seconds == 0 ? e.step_seconds() : 0.8 * step_seconds + 0.2 * e.step_seconds();
    }
    if (ctx.json) {
      out << Json(e) << "\n";
    } else if (e.step() >= 1) {
      const double eta = step_seconds * static_cast<double>(steps - e.step());
      const int width = 30,
                filled = static_cast<int>(width * e.step() / std::max<int64_t>(1, steps));
      out << absl::StrFormat("[%s%s] step %d/%d  loss %.4f  %.0f tokens/s  cache hit %.2f%s%s\n",
                             std::string(filled, '#'), std::string(width - filled, '.'), e.step(),
                             steps, e.loss(), e.tokens_per_second(), e.cache_hit_rate(),
                             // A job that waits (its message says for what) has no ETA.
                             e.state() == v1::JOB_STATE_RUNNING && e.message().empty()
                                 ? absl::StrFormat("  ETA %.0fs", eta)
                                 : "",
                             e.state() == v1::JOB_STATE_RUNNING && !e.message().empty()
                                 ? "  (" + e.message() + ")"
                                 : "");
    } else {
      // The scheduler's reason, where it gave one.
      const std::string waits =
          " (" + (e.message().empty() ? std::string("waiting for workers") : e.message()) + ")";
      out << "job " << e.job_id() << ": " << StateName(e.state())
          << (IsFinal(e.state()) ? ""
              : e.step() == 0    ? " (initial weights written)"
                                 : waits)
          << "\n";
    }
    out.flush();
    return true;
  }));
  const std::string why = last.message().empty() ? "" : " (" + last.message() + ")";
  if (!ctx.json && first_loss < 0) {  // no training step seen: nothing to sum up but the end
    out << absl::StrFormat("job %s %s at step %d%s\n", last.job_id(), StateName(last.state()),
                           std::max<int64_t>(0, last.step()), why);
  } else if (!ctx.json && first_step == last.step()) {  // one step seen: an ended job's last
    out << absl::StrFormat("job %s %s at step %d: loss %.4f, %.0f tokens/s, cache hit %.2f%s\n",
                           last.job_id(), StateName(last.state()), last.step(), last_loss,
                           tokens_per_second, hit_rate, why);
  } else if (!ctx.json) {
    // The loss from the first step this watch saw (a watch begun mid-job names that step).
    out << absl::StrFormat(
        "job %s %s at step %d: loss %.4f%s -> %.4f, %.0f tokens/s, cache hit %.2f%s\n",
        last.job_id(), StateName(last.state()), last.step(), first_loss,
        first_step > 1 ? absl::StrFormat(" (step %d)", first_step) : "", last_loss,
        tokens_per_second, hit_rate, why);
  }
  if (last.state() != v1::JOB_STATE_SUCCEEDED) {
    return absl::AbortedError(absl::StrCat("job ", args[0], " ended ", StateName(last.state()),
                                           last.message().empty() ? "" : ": " + last.message()));
  }
  return absl::OkStatus();
}

absl::Status Cancel(const CliContext& ctx, const Args& args, std::ostream& out) {
  RETURN_IF_ERROR(RefuseUnknownFlags("cancel", args));
  if (args.size() != 1) return UsageError("cancel takes one job id: pith cancel JOB");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  ASSIGN_OR_RETURN(v1::Job job, client->Cancel(args[0], "cancelled with pith cancel"));
  out << (ctx.json ? Json(job) : JobLine(job)) << "\n";
  return absl::OkStatus();
}

absl::Status Remove(const CliContext& ctx, const Args& args, std::ostream& out) {
  RETURN_IF_ERROR(RefuseUnknownFlags("remove", args));
  if (args.empty()) return UsageError("remove takes job ids: pith remove JOB...");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  // One by one, each said as it goes; one that cannot be removed does not stop the rest,
  // and the error line names every one that was not (with the first one's code).
  absl::Status first;
  std::vector<std::string> refused;
  for (const std::string& id : args) {
    absl::StatusOr<v1::Job> job = client->Remove(id);
    // The coordinator unreachable, or the caller not admitted: the same for every id.
    if (absl::IsUnavailable(job.status()) || absl::IsDeadlineExceeded(job.status()) ||
        absl::IsUnauthenticated(job.status())) {
      return job.status();
    }
    if (!job.ok()) {
      if (first.ok()) first = job.status();
      refused.push_back(std::string(job.status().message()));
      continue;
    }
    if (ctx.json) {
      out << Json(*job) << "\n";
    } else {
      out << "removed " << job->job_id() << " (" << StateName(job->state()) << ")\n";
    }
  }
  if (refused.empty()) return absl::OkStatus();
  if (args.size() == 1) return first;
  return absl::Status(first.code(),
                      absl::StrCat(refused.size(), " of ", args.size(),
                                   " jobs not removed: ", absl::StrJoin(refused, "; ")));
}

namespace {

// The partial file of the download in progress, for the signal handler below.
char g_partial[PATH_MAX + 64];

// The signal's default action is back (SA_RESETHAND): the CLI then dies of the signal, as
// a shell loop around it expects of ^C.
extern "C" void RemovePartialAndDie(int sig) {
  ::unlink(g_partial);
  ::raise(sig);
}

// While it lives, a stop signal removes the download's partial file before the CLI dies of
// it: the SDK removes it only on the errors it returns.
class RemovePartialOnSignal {
 public:
  explicit RemovePartialOnSignal(const std::string& partial) {
    if (partial.size() >= sizeof(g_partial)) return;
    std::copy(partial.begin(), partial.end(), g_partial);
    g_partial[partial.size()] = '\0';
    handlers_.emplace(RemovePartialAndDie, SA_RESETHAND | SA_NODEFER);
  }

 private:
  std::optional<OnStopSignals> handlers_;
};

}  // namespace

absl::Status Checkpoint(const CliContext& ctx, const Args& args, std::ostream& out) {
  RETURN_IF_ERROR(RefuseUnknownFlags("checkpoint", args, {"--out", "--force"}));
  Args rest = args;
  const auto forced = std::find(rest.begin(), rest.end(), "--force");
  const bool force = forced != rest.end();
  if (force) rest.erase(forced);
  if (rest.size() != 3 || rest[1] != "--out") {
    return UsageError(
        "checkpoint takes a job and a file: pith checkpoint JOB --out FILE [--force]");
  }
  if (rest[2].empty()) return UsageError("checkpoint --out needs a file name");
  std::error_code ec;
  const std::filesystem::path target = std::filesystem::absolute(rest[2], ec);
  if (ec) return UsageError(absl::StrCat("checkpoint --out ", rest[2], ": ", ec.message()));
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  // The coordinator streams the file: the client may be on any host.
  absl::StatusOr<v1::CheckpointJobResponse> r;
  {
    RemovePartialOnSignal guard(Client::PartialPath(target.string()));
    r = client->DownloadCheckpoint(rest[0], target.string(), force);
  }
  if (absl::IsAlreadyExists(r.status())) {
    return absl::AlreadyExistsError(absl::StrCat(r.status().message(), " (--force replaces it)"));
  }
  RETURN_IF_ERROR(r.status());
  if (ctx.json) {
    out << absl::StrFormat("{\"path\": \"%s\", \"step\": %d, \"bytes\": %d}\n", target.string(),
                           r->step(), r->bytes());
  } else {
    out << "wrote " << target.string() << " (step " << r->step() << ", " << r->bytes()
        << " bytes)\n";
  }
  return absl::OkStatus();
}

namespace {

// (layers, experts) of the heat's layer x expert grid.
std::pair<int, int> GridOf(const v1::ExpertHeatResponse& heat) {
  int layers = 0, experts = 0;
  for (const auto& e : heat.experts()) {
    layers = std::max(layers, e.expert().layer() + 1);
    experts = std::max(experts, e.expert().expert() + 1);
  }
  return {layers, experts};
}

// The heat as an SVG: a layer x expert grid, darker = hotter (per layer), each cell
// labelled with its compute and store replica counts.
std::string HeatSvg(const v1::ExpertHeatResponse& heat) {
  const auto [layers, experts] = GridOf(heat);
  // A placed expert has a store; an ended job's placement is gone (every count 0), so its
  // cells show how often each expert was fetched instead of replicas it no longer has.
  bool placed = false;
  for (const auto& e : heat.experts()) placed = placed || e.store_replicas() > 0;
  std::vector<double> layer_max(layers, 0);
  for (const auto& e : heat.experts()) {
    layer_max[e.expert().layer()] = std::max(layer_max[e.expert().layer()], e.heat());
  }
  const int cell = 36, left = 70, top = 40;
  const std::string title = absl::StrFormat(
      "%s: expert heat after step %d (label: %s)", heat.job_id(), heat.step(),
      placed ? "compute/store replicas" : "fetches into caches; the job has no placement now");
  // Wide enough for the title too: 13-px sans-serif averages under 8 px a character.
  const int width = std::max(left + experts * cell + 10, 5 + 8 * static_cast<int>(title.size()));
  std::ostringstream doc;
  doc << absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"10\">\n",
      width, top + layers * cell + 30);
  doc << absl::StrFormat("<text x=\"5\" y=\"20\" font-size=\"13\">%s</text>\n", title);
  for (int l = 0; l < layers; ++l) {
    doc << absl::StrFormat("<text x=\"5\" y=\"%d\">layer %d</text>\n", top + l * cell + 22, l);
  }
  for (int x = 0; x < experts; ++x) {
    doc << absl::StrFormat("<text x=\"%d\" y=\"%d\">e%d</text>\n", left + x * cell + 10,
                           top + layers * cell + 15, x);
  }
  for (const auto& e : heat.experts()) {
    const int l = e.expert().layer(), x = e.expert().expert();
    const double t = layer_max[l] > 0 ? e.heat() / layer_max[l] : 0;
    const int shade = static_cast<int>(255 - 200 * t);
    doc << absl::StrFormat(
        "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"rgb(255,%d,%d)\" "
        "stroke=\"#888\"><title>layer %d expert %d: heat %.1f</title></rect>\n",
        left + x * cell, top + l * cell, cell, cell, shade, shade, l, x, e.heat());
    const std::string label =
        placed ? absl::StrFormat("%d/%d", e.compute_replicas(), e.store_replicas())
               : absl::StrCat(e.fetches());
    doc << absl::StrFormat("<text x=\"%d\" y=\"%d\">%s</text>\n", left + x * cell + 8,
                           top + l * cell + 22, label);
  }
  doc << "</svg>\n";
  return doc.str();
}

}  // namespace

absl::Status Experts(const CliContext& ctx, const Args& args, std::ostream& out) {
  RETURN_IF_ERROR(RefuseUnknownFlags("experts", args, {"--svg"}));
  std::string svg;
  if (args.size() == 3 && args[1] == "--svg") {
    svg = args[2];
    if (svg.empty()) return UsageError("experts --svg needs a file name");
  } else if (args.size() != 1) {
    return UsageError(
        "experts takes a job and optionally --svg FILE: pith experts JOB [--svg FILE]");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  ASSIGN_OR_RETURN(v1::ExpertHeatResponse heat, client->ExpertHeat(args[0]));
  if (!svg.empty()) {  // first: a file that cannot be written is the answer, not the table
    const std::string text = HeatSvg(heat);
    RETURN_IF_ERROR(WriteFileAtomically(svg, [&](int fd) {
      return WriteAll(fd, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}, svg);
    }));
  }
  if (ctx.json) {
    out << Json(heat) << "\n";
  } else {
    const int layers = GridOf(heat).first;
    out << absl::StrFormat("job %s, heat after step %d, placement epoch %d\n", heat.job_id(),
                           heat.step(), heat.placement_epoch());
    for (int l = 0; l < layers; ++l) {
      double total = 0, top = 0;
      int hottest = -1;
      std::string row;
      for (const auto& e : heat.experts()) {
        if (e.expert().layer() != l) continue;
        total += e.heat();
        if (e.heat() > top) top = e.heat(), hottest = e.expert().expert();
        row += absl::StrFormat(" %6.0f", e.heat());
      }
      out << absl::StrFormat("layer %2d: hottest expert %d (%.0f%% of the layer's heat)\n        ",
                             l, hottest, total > 0 ? 100 * top / total : 0.0)
          << row << "\n";
    }
    for (const auto& p : heat.pairs()) {
      out << absl::StrFormat("co-activated: layer %d experts %d+%d (%.0f)\n", p.layer(),
                             p.expert_a(), p.expert_b(), p.weight());
    }
  }
  if (!svg.empty() && !ctx.json) out << "wrote " << svg << "\n";
  return absl::OkStatus();
}

namespace {

absl::Status ClusterDrain(const CliContext& ctx, const Args& args, std::ostream& out) {
  std::string store;
  bool wait = true;
  double timeout_s = 600;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--no-wait") {
      wait = false;
    } else if (args[i] == "--timeout") {
      if (i + 1 == args.size() || !absl::SimpleAtod(args[i + 1], &timeout_s) || timeout_s <= 0) {
        return UsageError("--timeout wants a number of seconds > 0");
      }
      ++i;
    } else if (absl::StartsWith(args[i], "--")) {
      return UsageError("cluster drain: unknown flag " + args[i]);
    } else if (store.empty()) {
      store = args[i];
    } else {
      return UsageError("cluster drain takes one store: pith cluster drain STORE");
    }
  }
  if (store.empty()) return UsageError("cluster drain takes one store: pith cluster drain STORE");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  ASSIGN_OR_RETURN(v1::DrainStoreResponse started, client->DrainStore(store));
  if (!ctx.json) {
    out << absl::StrFormat("draining %s: %d expert groups, %d blobs (%.1f MB) to move\n", store,
                           started.groups_to_move(), started.blobs_to_move(),
                           started.bytes_to_move() / 1e6);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  std::string last;
  while (true) {
    ASSIGN_OR_RETURN(v1::ClusterStatusResponse c, client->ClusterStatus());
    const v1::StoreDrain* drain = nullptr;
    for (const v1::StoreDrain& d : c.drains()) {
      if (d.store_id() == store) drain = &d;
    }
    if (drain == nullptr) {
      return absl::UnavailableError(absl::StrCat(
          "store ", store, " left the cluster while draining; blobs it held are re-replicated ",
          "from their other copies (see pith cluster)"));
    }
    if (!wait || drain->can_stop()) {
      if (ctx.json) {
        out << Json(*drain) << "\n";
      } else if (drain->can_stop()) {
        // What it still holds lives on elsewhere: running jobs' groups moved, and ended
        // jobs' kept weights were copied to the stores that stay.
        out << store << " is drained: nothing is placed on it any more, and ended jobs' "
            << "weights it held have copies on other stores; its process can be stopped now\n";
      } else {
        out << "the drain goes on; pith cluster shows its progress and when " << store
            << " can be stopped\n";
      }
      return absl::OkStatus();
    }
    int moving = 0;
    for (const v1::BlobMove& m : c.moves()) {
      moving += m.from_store_id() == store || m.to_store_id() == store;
    }
    const std::string line =
        absl::StrFormat("  %s: %d of %d groups still placed on it, %d copies in flight", store,
                        drain->groups_left(), drain->groups_total(), moving);
    if (line != last && !ctx.json) out << line << "\n" << std::flush;
    last = line;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("store ", store, " is still draining after ", timeout_s, " s (",
                       drain->groups_left(), " groups left; pith cluster shows the progress)"));
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
}

}  // namespace

absl::Status Cluster(const CliContext& ctx, const Args& args, std::ostream& out) {
  if (!args.empty() && args[0] == "drain")
    return ClusterDrain(ctx, Args(args.begin() + 1, args.end()), out);
  if (!args.empty()) return UsageError("cluster takes no arguments (or: cluster drain STORE)");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect(ctx));
  ASSIGN_OR_RETURN(v1::ClusterStatusResponse c, client->ClusterStatus());
  if (ctx.json) {
    out << Json(c) << "\n";
    return absl::OkStatus();
  }
  const int64_t now = absl::ToUnixMillis(absl::Now());
  auto member = [&](const v1::MemberInfo& m) {
    const std::string state =
        absl::AsciiStrToLower(absl::StripPrefix(v1::MemberState_Name(m.state()), "MEMBER_STATE_"));
    // A worker serves no gRPC port: its host alone.
    const absl::string_view address = absl::StripSuffix(m.grpc_address(), ":0");
    const double lease = (m.lease_expires_unix_ms() - now) / 1e3;
    out << absl::StrFormat("  %-10s %-8s %-21s %s", m.member_id(), state, address,
                           lease >= 0 ? absl::StrFormat("lease %5.1fs", lease)
                                      : absl::StrFormat("lease over %.0fs ago", -lease));
    if (m.role() == v1::MEMBER_ROLE_STORE) {
      out << absl::StrFormat("  ram %.1f MB / %.1f MB  rocksdb %.1f MB  disk free %.1f MB",
                             m.ram_bytes() / 1e6, m.capacity_bytes() / 1e6, m.rocksdb_bytes() / 1e6,
                             m.disk_free_bytes() / 1e6);
      if (m.disk_reserve_bytes() > 0 && m.disk_free_bytes() < m.disk_reserve_bytes()) {
        out << absl::StrFormat("  DISK FULL (under --disk_reserve_bytes, %.1f MB: puts refused)",
                               m.disk_reserve_bytes() / 1e6);
      } else if (m.disk_low()) {
        out << "  disk low (no new copies; its copies move to stores with room)";
      }
    } else {
      out << "  " << (m.backend() == v1::BACKEND_CUDA ? "cuda" : "cpu");
      if (!m.job_id().empty()) out << "  job " << m.job_id();
    }
    if (!m.health().empty()) out << "  UNHEALTHY (counts as dead): " << m.health();
    out << "\n";
  };
  out << "stores:\n";
  for (const auto& m : c.stores()) member(m);
  out << "workers:\n";
  for (const auto& m : c.workers()) member(m);
  out << absl::StrFormat("moves in flight %d, blobs moved %d (%.1f MB), replica deficit %d\n",
                         c.moves_size(), c.blobs_moved(), c.bytes_moved() / 1e6,
                         c.replica_deficit());
  for (const v1::BlobMove& m : c.moves()) {
    const std::string group =
        m.key().layer() < 0 ? std::string("dense")
                            : absl::StrCat("layer ", m.key().layer(), " expert ", m.key().expert());
    out << absl::StrFormat("  move %s %s: %s -> %s (%s)\n", m.key().job_id(), group,
                           m.from_store_id(), m.to_store_id(), m.reason());
  }
  for (const v1::StoreDrain& d : c.drains()) {
    out << absl::StrFormat("drain %s: %d of %d groups left%s\n", d.store_id(), d.groups_left(),
                           d.groups_total(), d.can_stop() ? ", drained: it can be stopped" : "");
  }
  return absl::OkStatus();
}

}  // namespace pith::cli
