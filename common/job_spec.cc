#include "common/job_spec.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/compute_dtype.h"
#include "common/file.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"

namespace pith {
namespace {

constexpr int64_t kMaxDim = int64_t{1} << 24;
// 2^40 parameters: far past any model this service will see, and far from overflow.
constexpr double kMaxParameters = 1099511627776.0;
// Experts of all layers: the coordinator keeps a placement entry, heat and copy state for
// each (DeepSeek-V3 has 58 x 256 = 14,848).
constexpr int64_t kMaxExperts = int64_t{1} << 17;

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("JobSpec ", field, ": ", what));
}

// Finds a key given twice in one object of JSON that protobuf's parser accepted (which
// keeps the last silently: a spec edited by adding a line would train with whichever
// came last). Keys are compared as protobuf maps them to fields: "n_layer" and "nLayer"
// are the same field. Anything unexpected ends the scan: the parser has judged the syntax.
class DuplicateKeyScan {
 public:
  explicit DuplicateKeyScan(absl::string_view json) : s_(json) {}

  // The dotted path of the first key given twice ("model.n_layer"), or "" when none is.
  std::string Run() {
    Value("", 0);
    return found_;
  }

 private:
  static constexpr int kMaxDepth = 64;

  void Space() {
    while (i_ < s_.size() && absl::ascii_isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool Stop() const { return !found_.empty() || failed_; }

  // A quoted key or string (either quote; an escape of an ASCII character decoded, as
  // protobuf decodes it: "\u0073teps" is "steps"), or a bare key.
  bool Key(std::string* out) {
    if (i_ >= s_.size()) return false;
    const char quote = s_[i_];
    if (quote != '"' && quote != '\'') {
      while (i_ < s_.size() && (absl::ascii_isalnum(static_cast<unsigned char>(s_[i_])) ||
                                s_[i_] == '_' || s_[i_] == '$')) {
        out->push_back(s_[i_++]);
      }
      return !out->empty();
    }
    for (++i_; i_ < s_.size() && s_[i_] != quote; ++i_) {
      if (s_[i_] != '\\' || i_ + 1 >= s_.size()) {
        out->push_back(s_[i_]);
        continue;
      }
      const char e = s_[++i_];
      unsigned code = 0;
      if (e == 'u' && i_ + 4 < s_.size() && absl::SimpleHexAtoi(s_.substr(i_ + 1, 4), &code) &&
          code < 0x80) {
        out->push_back(static_cast<char>(code));
        i_ += 4;
      } else {
        out->push_back('\\');  // any other escape: kept as written (no field has one)
        out->push_back(e);
      }
    }
    if (i_ >= s_.size()) return false;
    ++i_;
    return true;
  }

  static std::string FieldOf(absl::string_view key) {
    std::string field;
    for (char c : key) {
      if (c != '_') field.push_back(absl::ascii_tolower(static_cast<unsigned char>(c)));
    }
    return field;
  }

  void Object(const std::string& path, int depth) {
    ++i_;  // '{'
    std::set<std::string> fields;
    for (Space(); !Stop() && i_ < s_.size() && s_[i_] != '}'; Space()) {
      std::string key;
      if (!Key(&key)) return void(failed_ = true);
      const std::string at = path.empty() ? key : absl::StrCat(path, ".", key);
      if (!fields.insert(FieldOf(key)).second) return void(found_ = at);
      Space();
      if (i_ >= s_.size() || s_[i_] != ':') return void(failed_ = true);
      ++i_;
      Value(at, depth + 1);
      Space();
      if (i_ < s_.size() && s_[i_] == ',') ++i_;
    }
    ++i_;  // '}'
  }

  void Value(const std::string& path, int depth) {
    Space();
    if (Stop() || i_ >= s_.size() || depth > kMaxDepth) return void(failed_ = true);
    const char c = s_[i_];
    if (c == '{') return Object(path, depth);
    if (c == '"' || c == '\'') {
      std::string ignored;
      if (!Key(&ignored)) failed_ = true;
      return;
    }
    if (c == '[') {
      ++i_;
      for (Space(); !Stop() && i_ < s_.size() && s_[i_] != ']'; Space()) {
        Value(path, depth + 1);
        Space();
        if (i_ < s_.size() && s_[i_] == ',') ++i_;
      }
      ++i_;
      return;
    }
    // A number, true, false or null.
    const size_t start = i_;
    while (i_ < s_.size() && s_[i_] != ',' && s_[i_] != '}' && s_[i_] != ']' &&
           !absl::ascii_isspace(static_cast<unsigned char>(s_[i_]))) {
      ++i_;
    }
    if (i_ == start) failed_ = true;
  }

  absl::string_view s_;
  size_t i_ = 0;
  std::string found_;
  bool failed_ = false;
};

absl::Status CheckRange(absl::string_view field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    return FieldError(field, absl::StrCat("must be in [", lo, ", ", hi, "], got ", v));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(absl::string_view field, double v) {
  if (!std::isfinite(v)) return FieldError(field, absl::StrCat("must be finite, got ", v));
  return absl::OkStatus();
}

// lo <= v (or lo < v when `open_lo`) and v <= hi (or v < hi when `open_hi`).
absl::Status CheckInterval(absl::string_view field, double v, double lo, bool open_lo, double hi,
                           bool open_hi) {
  RETURN_IF_ERROR(CheckFinite(field, v));
  const bool ok = (open_lo ? v > lo : v >= lo) && (open_hi ? v < hi : v <= hi);
  if (!ok) {
    return FieldError(field, absl::StrCat("must be in ", open_lo ? "(" : "[", lo, ", ", hi,
                                          open_hi ? ")" : "]", ", got ", v));
  }
  return absl::OkStatus();
}

absl::Status ValidateModel(const v1::ModelConfig& m) {
  RETURN_IF_ERROR(CheckRange("model.vocab_size", m.vocab_size(), 2, 65536));
  RETURN_IF_ERROR(CheckRange("model.seq_len", m.seq_len(), 1, kMaxDim));
  RETURN_IF_ERROR(CheckRange("model.d_model", m.d_model(), 1, kMaxDim));
  RETURN_IF_ERROR(CheckRange("model.n_layer", m.n_layer(), 1, 4096));
  RETURN_IF_ERROR(CheckRange("model.n_head", m.n_head(), 1, m.d_model()));
  if (m.d_model() % m.n_head() != 0) {
    return FieldError("model.n_head", absl::StrCat("must divide model.d_model ", m.d_model(),
                                                   ", got ", m.n_head()));
  }
  RETURN_IF_ERROR(CheckRange("model.n_expert", m.n_expert(), 1, 65536));
  RETURN_IF_ERROR(CheckRange("model.top_k", m.top_k(), 1, m.n_expert()));
  RETURN_IF_ERROR(CheckRange("model.d_ff", m.d_ff(), 1, kMaxDim));
  RETURN_IF_ERROR(
      CheckInterval("model.capacity_factor", m.capacity_factor(), -1e9, false, 1e9, false));
  RETURN_IF_ERROR(CheckInterval("model.aux_loss_coef", m.aux_loss_coef(), 0, false, 1e6, false));
  RETURN_IF_ERROR(CheckInterval("model.z_loss_coef", m.z_loss_coef(), 0, false, 1e6, false));
  if (!ParseComputeDtype(m.compute_dtype()).ok()) {
    return FieldError("model.compute_dtype",
                      absl::StrCat("must be fp32 or bf16, got \"", m.compute_dtype(), "\""));
  }

  if (int64_t{m.n_layer()} * m.n_expert() > kMaxExperts) {
    return FieldError("model.n_expert",
                      absl::StrCat("n_layer x n_expert is ", int64_t{m.n_layer()} * m.n_expert(),
                                   " experts, more than the limit of ", kMaxExperts));
  }
  const double d = m.d_model(), f = m.d_ff(), e = m.n_expert(), layers = m.n_layer();
  const double params = m.vocab_size() * d + m.seq_len() * d +
                        layers * (4 * d * d + 9 * d + d * e + e * (2 * d * f + f + d)) + 2 * d;
  if (params > kMaxParameters) {
    return FieldError("model", absl::StrCat("has ", params, " parameters, more than the limit of ",
                                            kMaxParameters));
  }
  return absl::OkStatus();
}

// A file name a worker will open: at most PATH_MAX bytes, no control characters.
absl::Status CheckPath(absl::string_view field, const std::string& path) {
  constexpr size_t kMaxPath = 4096;
  if (path.size() > kMaxPath) {
    return FieldError(
        field, absl::StrCat("is ", path.size(), " bytes long, more than the limit of ", kMaxPath));
  }
  if (HasControlCharacter(path)) return FieldError(field, "holds a control character");
  return absl::OkStatus();
}

absl::Status ValidateTrain(const v1::TrainConfig& t) {
  if (t.data_path().empty()) return FieldError("train.data_path", "is required");
  RETURN_IF_ERROR(CheckPath("train.data_path", t.data_path()));
  RETURN_IF_ERROR(CheckPath("train.init_path", t.init_path()));
  RETURN_IF_ERROR(CheckRange("train.batch", t.batch(), 1, kMaxDim));
  RETURN_IF_ERROR(CheckRange("train.steps", t.steps(), 1, int64_t{1} << 30));
  RETURN_IF_ERROR(CheckInterval("train.lr", t.lr(), 0, true, 10, false));
  RETURN_IF_ERROR(CheckRange("train.warmup", t.warmup(), 0, int64_t{1} << 30));
  RETURN_IF_ERROR(CheckInterval("train.min_lr_ratio", t.min_lr_ratio(), 0, false, 1, false));
  RETURN_IF_ERROR(CheckInterval("train.weight_decay", t.weight_decay(), 0, false, 1e3, false));
  RETURN_IF_ERROR(CheckInterval("train.grad_clip", t.grad_clip(), 0, false, 1e9, false));
  RETURN_IF_ERROR(CheckInterval("train.beta1", t.beta1(), 0, false, 1, true));
  RETURN_IF_ERROR(CheckInterval("train.beta2", t.beta2(), 0, false, 1, true));
  RETURN_IF_ERROR(CheckInterval("train.eps", t.eps(), 0, true, 1, false));
  return absl::OkStatus();
}

absl::Status ValidateCluster(const v1::ClusterConfig& c) {
  RETURN_IF_ERROR(CheckRange("cluster.workers", c.workers(), 1, 4096));
  RETURN_IF_ERROR(CheckRange("cluster.store_replicas", c.store_replicas(), 1, 16));
  if (c.cache_bytes() < 0) {
    return FieldError("cluster.cache_bytes", absl::StrCat("must be >= 0, got ", c.cache_bytes()));
  }
  const v1::ReplicationConfig& r = c.replication();
  RETURN_IF_ERROR(CheckRange("cluster.replication.max_compute_replicas", r.max_compute_replicas(),
                             1, c.workers()));
  RETURN_IF_ERROR(CheckRange("cluster.replication.max_store_replicas", r.max_store_replicas(),
                             c.store_replicas(), 16));
  RETURN_IF_ERROR(
      CheckInterval("cluster.replication.heat_decay", r.heat_decay(), 0, true, 1, false));
  RETURN_IF_ERROR(
      CheckInterval("cluster.replication.hot_threshold", r.hot_threshold(), 0, true, 1e6, false));
  RETURN_IF_ERROR(CheckRange("cluster.replication.replan_every", r.replan_every(), 1, 1 << 20));
  return absl::OkStatus();
}

}  // namespace

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
}

bool HasControlCharacter(absl::string_view text) {
  return std::any_of(text.begin(), text.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; });
}

void ApplyJobSpecDefaults(v1::JobSpec* spec) {
  // -0 means 0 everywhere in a spec; keeping the sign would make equal specs differ.
  v1::ModelConfig* m = spec->mutable_model();
  m->set_capacity_factor(m->capacity_factor() + 0.0);
  m->set_aux_loss_coef(m->aux_loss_coef() + 0.0);
  m->set_z_loss_coef(m->z_loss_coef() + 0.0);
  v1::TrainConfig* t = spec->mutable_train();
  t->set_lr(t->lr() + 0.0);
  t->set_weight_decay(t->weight_decay() + 0.0);
  t->set_grad_clip(t->grad_clip() + 0.0);
  if (t->has_min_lr_ratio()) t->set_min_lr_ratio(t->min_lr_ratio() + 0.0);
  if (!t->has_min_lr_ratio()) t->set_min_lr_ratio(0.1);
  if (!t->has_beta1()) t->set_beta1(0.9);
  if (!t->has_beta2()) t->set_beta2(0.95);
  if (!t->has_eps()) t->set_eps(1e-8);

  v1::ClusterConfig* c = spec->mutable_cluster();
  if (c->workers() == 0) c->set_workers(1);
  if (c->store_replicas() == 0) c->set_store_replicas(1);
  v1::ReplicationConfig* r = c->mutable_replication();
  if (r->max_compute_replicas() == 0) r->set_max_compute_replicas(1);
  if (r->max_store_replicas() == 0) r->set_max_store_replicas(c->store_replicas());
  if (r->heat_decay() == 0) r->set_heat_decay(0.9);
  if (r->hot_threshold() == 0) r->set_hot_threshold(2.0);
  if (r->replan_every() == 0) r->set_replan_every(10);
}

static absl::Status ValidateName(const std::string& name) {
  if (name.empty() || name.size() > 64) {
    return FieldError("name", absl::StrCat("must have 1 to 64 characters, got ", name.size()));
  }
  for (char ch : name) {
    if (!IsNameChar(ch)) {
      return FieldError("name", "may hold only letters, digits, '-', '_' and '.'");
    }
  }
  return absl::OkStatus();
}

// What no single part can see: every worker trains rows of its own.
absl::Status ValidateAcrossParts(const v1::JobSpec& spec) {
  const int workers = spec.cluster().workers();
  if (workers > 0 && spec.train().batch() > 0 && spec.train().batch() < workers) {
    return FieldError("train.batch", absl::StrCat("must be at least cluster.workers (", workers,
                                                  "): each worker trains rows of its own, got ",
                                                  spec.train().batch()));
  }
  return absl::OkStatus();
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  // The first bad field of each part, all in one answer: one fix-and-retry round per part
  // at most.
  std::string problems;
  for (const absl::Status& s :
       {ValidateName(spec.name()), ValidateModel(spec.model()), ValidateTrain(spec.train()),
        ValidateCluster(spec.cluster()), ValidateAcrossParts(spec)}) {
    if (!s.ok()) absl::StrAppend(&problems, problems.empty() ? "" : "; ", s.message());
  }
  return problems.empty() ? absl::OkStatus() : absl::InvalidArgumentError(problems);
}

absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view json) {
  v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &spec, options);
  if (!status.ok()) {
    // protobuf's parser ends its message with the text around where it stopped (which
    // may span lines of the file) and a caret line under it: one line here, the text
    // quoted with its line breaks as spaces.
    std::string message(status.message());
    if (const size_t nl = message.find('\n'); nl != std::string::npos) {
      std::string near = message.substr(nl + 1);
      const size_t caret = near.rfind('\n');
      if (caret != std::string::npos &&
          absl::StripAsciiWhitespace(near.substr(caret + 1)).find_first_not_of('^') ==
              absl::string_view::npos) {
        near.resize(caret);
      }
      std::replace(near.begin(), near.end(), '\n', ' ');
      near = std::string(absl::StripAsciiWhitespace(near));
      message = absl::StrCat(message.substr(0, nl), near.empty() ? "" : " (at: ", near,
                             near.empty() ? "" : ")");
    }
    return absl::InvalidArgumentError(absl::StrCat("JobSpec JSON: ", message));
  }
  if (const std::string twice = DuplicateKeyScan(json).Run(); !twice.empty()) {
    return FieldError(twice, "given twice; JSON keeps only one of them, so remove the other");
  }
  ApplyJobSpecDefaults(&spec);
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  return spec;
}

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path) {
  ASSIGN_OR_RETURN(Buffer bytes, ReadFile(path));
  absl::StatusOr<v1::JobSpec> spec =
      ParseJobSpec(absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  if (!spec.ok()) return Annotate(spec.status(), path);
  return spec;
}

std::string JobSpecToJson(const v1::JobSpec& spec) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  // Only fails for messages with Any fields of unknown types; JobSpec has none.
  (void)google::protobuf::util::MessageToJsonString(spec, &out, options);
  return out;
}

}  // namespace pith
