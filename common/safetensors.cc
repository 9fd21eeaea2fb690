#include "common/safetensors.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace pith {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; Pith reads it in place");

using google::protobuf::Struct;
using google::protobuf::Value;

// Largest integer a JSON number (a double) holds exactly.
constexpr double kMaxJsonInteger = 9007199254740992.0;  // 2^53

absl::Status Invalid(absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", msg));
}

absl::StatusOr<uint64_t> JsonUint(const Value& v, absl::string_view what) {
  if (v.kind_case() != Value::kNumberValue) return Invalid(absl::StrCat(what, " is not a number"));
  const double d = v.number_value();
  if (!std::isfinite(d) || d < 0 || d != std::floor(d) || d > kMaxJsonInteger) {
    return Invalid(absl::StrCat(what, " is not a non-negative integer"));
  }
  return static_cast<uint64_t>(d);
}

absl::StatusOr<SafetensorsEntry> ParseEntry(const std::string& name, const Value& value) {
  const std::string where = absl::StrCat("tensor \"", name, "\"");
  if (value.kind_case() != Value::kStructValue)
    return Invalid(absl::StrCat(where, " is not an object"));
  const auto& fields = value.struct_value().fields();
  for (const auto& [key, unused] : fields) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return Invalid(absl::StrCat(where, " has unknown field \"", key, "\""));
    }
  }
  SafetensorsEntry entry;
  entry.name = name;

  auto dtype_it = fields.find("dtype");
  if (dtype_it == fields.end() || dtype_it->second.kind_case() != Value::kStringValue) {
    return Invalid(absl::StrCat(where, " has no string \"dtype\""));
  }
  absl::StatusOr<DType> dtype = DTypeFromName(dtype_it->second.string_value());
  if (!dtype.ok()) return Invalid(absl::StrCat(where, ": ", dtype.status().message()));
  entry.dtype = *dtype;

  auto shape_it = fields.find("shape");
  if (shape_it == fields.end() || shape_it->second.kind_case() != Value::kListValue) {
    return Invalid(absl::StrCat(where, " has no list \"shape\""));
  }
  for (const Value& dim : shape_it->second.list_value().values()) {
    ASSIGN_OR_RETURN(uint64_t d, JsonUint(dim, absl::StrCat(where, " shape entry")));
    entry.shape.push_back(static_cast<int64_t>(d));
  }

  auto offsets_it = fields.find("data_offsets");
  if (offsets_it == fields.end() || offsets_it->second.kind_case() != Value::kListValue ||
      offsets_it->second.list_value().values_size() != 2) {
    return Invalid(absl::StrCat(where, " has no \"data_offsets\" pair"));
  }
  const auto& offsets = offsets_it->second.list_value().values();
  ASSIGN_OR_RETURN(entry.begin, JsonUint(offsets[0], absl::StrCat(where, " data_offsets[0]")));
  ASSIGN_OR_RETURN(entry.end, JsonUint(offsets[1], absl::StrCat(where, " data_offsets[1]")));
  if (entry.begin > entry.end) {
    return Invalid(absl::StrCat(where, " has data_offsets [", entry.begin, ", ", entry.end,
                                "] that end before they begin"));
  }

  absl::StatusOr<int64_t> numel = CheckedNumel(entry.shape, entry.dtype);
  if (!numel.ok()) return Invalid(absl::StrCat(where, ": ", numel.status().message()));
  const uint64_t need = static_cast<uint64_t>(*numel) * DTypeSize(entry.dtype);
  if (entry.end - entry.begin != need) {
    return Invalid(absl::StrCat(where, " spans ", entry.end - entry.begin, " bytes but ",
                                DTypeName(entry.dtype), " ", ShapeString(entry.shape), " needs ",
                                need));
  }
  return entry;
}

absl::Status ParseMetadata(const Value& value, std::map<std::string, std::string>* out) {
  if (value.kind_case() != Value::kStructValue) return Invalid("__metadata__ is not an object");
  for (const auto& [key, v] : value.struct_value().fields()) {
    if (v.kind_case() != Value::kStringValue) {
      return Invalid(absl::StrCat("__metadata__ entry \"", key, "\" is not a string"));
    }
    (*out)[key] = v.string_value();
  }
  return absl::OkStatus();
}

// Appends `s` as a JSON string literal.
void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", c);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

}  // namespace

absl::Status ParseSafetensorsHeader(absl::string_view header, uint64_t data_size,
                                    std::vector<SafetensorsEntry>* entries,
                                    std::map<std::string, std::string>* metadata) {
  if (header.empty() || header[0] != '{') return Invalid("header is not a JSON object");
  Struct root;
  google::protobuf::util::JsonParseOptions options;
  auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(header.data(), header.size()), &root, options);
  if (!parsed.ok()) {
    return Invalid(absl::StrCat("header is not valid JSON: ", std::string(parsed.message())));
  }
  entries->clear();
  metadata->clear();
  for (const auto& [name, value] : root.fields()) {
    if (name == "__metadata__") {
      RETURN_IF_ERROR(ParseMetadata(value, metadata));
      continue;
    }
    if (name.empty()) return Invalid("a tensor has an empty name");
    ASSIGN_OR_RETURN(SafetensorsEntry entry, ParseEntry(name, value));
    entries->push_back(std::move(entry));
  }

  // The data must be exactly covered by the tensors: no overlap, no gap, nothing past
  // the end and nothing left over.
  std::vector<const SafetensorsEntry*> by_offset;
  by_offset.reserve(entries->size());
  for (const SafetensorsEntry& e : *entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry* e : by_offset) {
    if (e->begin < covered) {
      return Invalid(
          absl::StrCat("tensors \"", previous->name, "\" and \"", e->name, "\" overlap"));
    }
    if (e->begin > covered) {
      return Invalid(
          absl::StrCat("bytes [", covered, ", ", e->begin, ") of the data belong to no tensor"));
    }
    if (e->end > data_size) {
      return absl::DataLossError(absl::StrCat("safetensors: truncated: tensor \"", e->name,
                                              "\" ends at byte ", e->end,
                                              " of the data but the file holds only ", data_size));
    }
    covered = e->end;
    previous = e;
  }
  if (covered != data_size) {
    return Invalid(absl::StrCat(data_size - covered, " trailing bytes after the last tensor"));
  }
  std::sort(entries->begin(), entries->end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SafetensorsHeaderLength(absl::Span<const uint8_t> first8,
                                                 uint64_t file_size) {
  if (file_size < 8 || first8.size() < 8) {
    return Invalid(absl::StrCat("file of ", file_size, " bytes has no 8-byte header length"));
  }
  uint64_t header_len;
  std::memcpy(&header_len, first8.data(), 8);
  // The value read is not quoted: the file may be anything a caller named (a job's
  // init_path), and its first bytes are not the caller's to see.
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return Invalid(absl::StrCat("header length (its first 8 bytes) exceeds the limit of ",
                                kMaxSafetensorsHeaderBytes, " bytes: not a safetensors file"));
  }
  if (header_len > file_size - 8) {
    return Invalid(absl::StrCat("header length (its first 8 bytes) exceeds the ", file_size - 8,
                                " bytes after the length field"));
  }
  return header_len;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(Buffer file) {
  ASSIGN_OR_RETURN(
      const uint64_t header_len,
      SafetensorsHeaderLength({file.data(), std::min<size_t>(file.size(), 8)}, file.size()));
  const absl::string_view header(reinterpret_cast<const char*>(file.data()) + 8, header_len);
  SafetensorsFile result;
  RETURN_IF_ERROR(ParseSafetensorsHeader(header, file.size() - 8 - header_len, &result.entries_,
                                         &result.metadata_));
  result.data_offset_ = 8 + header_len;
  result.file_ = std::move(file);
  return result;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  ASSIGN_OR_RETURN(Buffer bytes, ReadFile(path));
  absl::StatusOr<SafetensorsFile> file = Parse(std::move(bytes));
  if (!file.ok()) return Annotate(file.status(), path);
  return file;
}

bool SafetensorsFile::Contains(absl::string_view name) const { return Get(name).ok(); }

absl::StatusOr<TensorView> SafetensorsFile::Get(absl::string_view name) const {
  auto it =
      std::lower_bound(entries_.begin(), entries_.end(), name,
                       [](const SafetensorsEntry& e, absl::string_view n) { return e.name < n; });
  if (it == entries_.end() || it->name != name) {
    return absl::NotFoundError(absl::StrCat("safetensors: no tensor \"", name, "\""));
  }
  const uint8_t* base = file_.data() + data_offset_;
  return TensorView{it->dtype, it->shape, {base + it->begin, it->end - it->begin}};
}

absl::Status SafetensorsWriter::Add(std::string name, TensorView tensor) {
  if (name.empty() || name == "__metadata__") {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: bad tensor name \"", name, "\""));
  }
  ASSIGN_OR_RETURN(int64_t numel, CheckedNumel(tensor.shape, tensor.dtype));
  const uint64_t need = static_cast<uint64_t>(numel) * DTypeSize(tensor.dtype);
  if (tensor.bytes.size() != need) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: tensor \"", name, "\" has ", tensor.bytes.size(), " bytes but ",
                     DTypeName(tensor.dtype), " ", ShapeString(tensor.shape), " needs ", need));
  }
  auto [it, inserted] = tensors_.emplace(std::move(name), std::move(tensor));
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("safetensors: tensor \"", it->first, "\" added twice"));
  }
  return absl::OkStatus();
}

void SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

std::string SafetensorsWriter::BuildHeader(
    std::vector<const std::pair<const std::string, TensorView>*>* order) const {
  // Wider dtypes first keeps every tensor aligned to its element size without padding.
  order->clear();
  for (const auto& entry : tensors_) order->push_back(&entry);
  std::stable_sort(order->begin(), order->end(), [](const auto* a, const auto* b) {
    return DTypeSize(a->second.dtype) > DTypeSize(b->second.dtype);
  });

  std::string json = "{";
  bool first = true;
  if (!metadata_.empty()) {
    json.append("\"__metadata__\":{");
    for (const auto& [k, v] : metadata_) {
      if (!first) json.push_back(',');
      first = false;
      AppendJsonString(&json, k);
      json.push_back(':');
      AppendJsonString(&json, v);
    }
    json.push_back('}');
  }
  uint64_t offset = 0;
  for (const auto* entry : *order) {
    if (json.size() > 1) json.push_back(',');
    const TensorView& t = entry->second;
    AppendJsonString(&json, entry->first);
    absl::StrAppend(&json, ":{\"dtype\":\"", DTypeName(t.dtype), "\",\"shape\":[");
    for (size_t i = 0; i < t.shape.size(); ++i) {
      absl::StrAppend(&json, i ? "," : "", t.shape[i]);
    }
    absl::StrAppend(&json, "],\"data_offsets\":[", offset, ",", offset + t.bytes.size(), "]}");
    offset += t.bytes.size();
  }
  json.push_back('}');
  // Pad with spaces so the data starts 8-byte aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  return json;
}

std::string SafetensorsWriter::Serialize() const {
  std::vector<const std::pair<const std::string, TensorView>*> order;
  const std::string header = BuildHeader(&order);
  std::string out(8, '\0');
  const uint64_t len = header.size();
  std::memcpy(out.data(), &len, 8);
  out.append(header);
  for (const auto* entry : order) {
    out.append(reinterpret_cast<const char*>(entry->second.bytes.data()),
               entry->second.bytes.size());
  }
  return out;
}

absl::Status SafetensorsWriter::Write(const std::string& path, bool replace) const {
  return WriteWith(
      path,
      [&](int fd, const std::map<std::string, uint64_t>& offsets) {
        for (const auto& [name, tensor] : tensors_) {
          RETURN_IF_ERROR(PwriteAll(fd, tensor.bytes, offsets.at(name), path));
        }
        return absl::OkStatus();
      },
      replace);
}

absl::Status SafetensorsWriter::WriteWith(const std::string& path, const Fill& fill,
                                          bool replace) const {
  std::vector<const std::pair<const std::string, TensorView>*> order;
  const std::string header = BuildHeader(&order);
  std::map<std::string, uint64_t> offsets;
  uint64_t offset = 8 + header.size();
  for (const auto* entry : order) {
    offsets[entry->first] = offset;
    offset += entry->second.bytes.size();
  }
  return WriteFileAtomically(
      path,
      [&](int fd) -> absl::Status {
        uint8_t len[8];
        const uint64_t n = header.size();
        std::memcpy(len, &n, 8);
        RETURN_IF_ERROR(WriteAll(fd, len, path));
        RETURN_IF_ERROR(
            WriteAll(fd, {reinterpret_cast<const uint8_t*>(header.data()), header.size()}, path));
        return fill(fd, offsets);
      },
      replace);
}

}  // namespace pith
