#include "tokenizer/grammar.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

namespace flywheel::tokenizer {
namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;  // code points, inclusive

// Sorted, merged.
Ranges Normalise(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, hi);
    } else {
      out.push_back({lo, hi});
    }
  }
  return out;
}

Ranges Complement(const Ranges& in) {
  Ranges r = Normalise(in), out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : r) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return out;
}

// The regex AST.
struct Node {
  enum Kind { kEmpty, kSet, kConcat, kAlt, kRepeat } kind = kEmpty;
  Ranges ranges;                // kSet
  std::vector<Node> children;   // kConcat, kAlt; kRepeat: one
  int64_t min = 0, max = -1;    // kRepeat; max -1: unbounded
};

Node SetNode(Ranges r) {
  Node n;
  n.kind = Node::kSet;
  n.ranges = Normalise(std::move(r));
  return n;
}

// Decodes the UTF-8 character at text[*pos]; false when it is not valid UTF-8.
bool DecodeUtf8(std::string_view text, size_t* pos, uint32_t* cp) {
  const auto b = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t c = b(*pos);
  const int n = c < 0x80 ? 0 : c >= 0xC2 && c < 0xE0 ? 1 : c >= 0xE0 && c < 0xF0 ? 2 : c >= 0xF0 && c < 0xF5 ? 3 : -1;
  if (n < 0 || *pos + n >= text.size()) return false;
  uint32_t v = n == 0 ? c : c & (0x3F >> n);
  for (int i = 1; i <= n; ++i) {
    const uint8_t cc = b(*pos + i);
    if ((cc & 0xC0) != 0x80) return false;
    v = (v << 6) | (cc & 0x3F);
  }
  static const uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  if (v < kMin[n] || v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) return false;
  *pos += n + 1;
  *cp = v;
  return true;
}

class RegexParser {
 public:
  explicit RegexParser(std::string_view p) : p_(p) {}

  Result<Node> Parse() {
    if (!p_.empty() && p_[0] == '^') ++pos_;
    FW_ASSIGN_OR_RETURN(Node n, Alternation(0));
    if (pos_ < p_.size()) return Error("unbalanced ')'");
    return n;
  }

 private:
  Status Error(const std::string& what) const {
    return Status::InvalidArgument("regex: " + what + " at byte " + std::to_string(pos_) + " of '" +
                                   std::string(p_.substr(0, 200)) + "'");
  }
  bool AtEnd() const { return pos_ >= p_.size(); }
  // A `$` that ends the pattern (or the alternative before a ')' or '|').
  bool EndAnchor() const {
    if (p_[pos_] != '$') return false;
    return pos_ + 1 == p_.size() || p_[pos_ + 1] == ')' || p_[pos_ + 1] == '|';
  }

  Result<Node> Alternation(int depth) {
    if (depth > 100) return Error("groups nested deeper than 100");
    Node alt;
    alt.kind = Node::kAlt;
    while (true) {
      FW_ASSIGN_OR_RETURN(Node c, Concatenation(depth));
      alt.children.push_back(std::move(c));
      if (AtEnd() || p_[pos_] != '|') break;
      ++pos_;
    }
    if (alt.children.size() == 1) return std::move(alt.children[0]);
    return alt;
  }

  Result<Node> Concatenation(int depth) {
    Node cat;
    cat.kind = Node::kConcat;
    while (!AtEnd() && p_[pos_] != '|' && p_[pos_] != ')') {
      if (EndAnchor()) {
        ++pos_;
        continue;
      }
      FW_ASSIGN_OR_RETURN(Node atom, Atom(depth));
      FW_ASSIGN_OR_RETURN(Node q, Quantified(std::move(atom)));
      cat.children.push_back(std::move(q));
    }
    if (cat.children.size() == 1) return std::move(cat.children[0]);
    if (cat.children.empty()) return Node{};
    return cat;
  }

  Result<int64_t> Number() {
    int64_t v = 0;
    const size_t start = pos_;
    while (!AtEnd() && p_[pos_] >= '0' && p_[pos_] <= '9') {
      v = v * 10 + (p_[pos_++] - '0');
      if (v > kRegexMaxRepeat) return Error("a repetition count over " + std::to_string(kRegexMaxRepeat));
    }
    if (pos_ == start) return Error("a repetition count expected");
    return v;
  }

  // {n}, {n,}, {n,m} after the '{'.
  Status Braces(int64_t& min, int64_t& max) {
    FW_ASSIGN_OR_RETURN(min, Number());
    max = min;
    if (!AtEnd() && p_[pos_] == ',') {
      ++pos_;
      max = -1;
      if (!AtEnd() && p_[pos_] != '}') {
        FW_ASSIGN_OR_RETURN(max, Number());
      }
    }
    if (AtEnd() || p_[pos_] != '}') return Error("'}' expected");
    ++pos_;
    if (max >= 0 && max < min) return Error("{n,m} with m < n");
    return Status::Ok();
  }

  Result<Node> Quantified(Node atom) {
    while (!AtEnd()) {
      const char c = p_[pos_];
      int64_t min = 0, max = -1;
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        ++pos_, min = 1;
      } else if (c == '?') {
        ++pos_, max = 1;
      } else if (c == '{' && pos_ + 1 < p_.size() && p_[pos_ + 1] >= '0' && p_[pos_ + 1] <= '9') {
        ++pos_;
        FW_RETURN_IF_ERROR(Braces(min, max));
      } else {
        break;
      }
      if (!AtEnd() && p_[pos_] == '+') return Error("possessive quantifiers are not supported");
      if (!AtEnd() && p_[pos_] == '?') ++pos_;  // lazy: the same language
      Node r;
      r.kind = Node::kRepeat;
      r.min = min;
      r.max = max;
      r.children.push_back(std::move(atom));
      atom = std::move(r);
    }
    return atom;
  }

  Result<Node> Group(int depth) {
    ++pos_;  // '('
    if (!AtEnd() && p_[pos_] == '?') {
      if (p_.substr(pos_, 2) == "?:") {
        pos_ += 2;
      } else if (p_.substr(pos_, 3) == "?P<" ||
                 (p_.substr(pos_, 2) == "?<" && p_.substr(pos_, 3) != "?<=" && p_.substr(pos_, 3) != "?<!")) {
        const size_t close = p_.find('>', pos_);
        if (close == std::string_view::npos) return Error("unterminated group name");
        pos_ = close + 1;
      } else if (p_.substr(pos_, 2) == "?=" || p_.substr(pos_, 2) == "?!" || p_.substr(pos_, 3) == "?<=" ||
                 p_.substr(pos_, 3) == "?<!") {
        return Error("lookaround is not supported");
      } else {
        return Error("inline flags and other (?...) groups are not supported");
      }
    }
    FW_ASSIGN_OR_RETURN(Node inner, Alternation(depth + 1));
    if (AtEnd() || p_[pos_] != ')') return Error("')' expected");
    ++pos_;
    return inner;
  }

  Result<uint32_t> Hex(size_t digits) {
    if (pos_ + digits > p_.size()) return Error("a hex escape is cut short");
    uint32_t v = 0;
    for (size_t i = 0; i < digits; ++i) {
      const char c = p_[pos_ + i];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) return Error("a bad hex digit in an escape");
      v = v * 16 + d;
    }
    pos_ += digits;
    if (v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) return Error("an escape outside Unicode scalar values");
    return v;
  }

  // After a '\\': the set it stands for.
  Result<Ranges> Escape() {
    if (AtEnd()) return Error("a trailing backslash");
    const char c = p_[pos_++];
    const Ranges digit = {{'0', '9'}}, word = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}},
                 space = {{'\t', '\r'}, {' ', ' '}};
    switch (c) {
      case 'd': return digit;
      case 'D': return Complement(digit);
      case 'w': return word;
      case 'W': return Complement(word);
      case 's': return space;
      case 'S': return Complement(space);
      case 'n': return Ranges{{'\n', '\n'}};
      case 'r': return Ranges{{'\r', '\r'}};
      case 't': return Ranges{{'\t', '\t'}};
      case 'f': return Ranges{{'\f', '\f'}};
      case 'v': return Ranges{{'\v', '\v'}};
      case 'x': {
        FW_ASSIGN_OR_RETURN(uint32_t v, Hex(2));
        return Ranges{{v, v}};
      }
      case 'u': {
        FW_ASSIGN_OR_RETURN(uint32_t v, Hex(4));
        return Ranges{{v, v}};
      }
      case 'b': case 'B': return Error("word boundaries (\\b, \\B) are not supported");
      default: break;
    }
    if ((c >= '0' && c <= '9')) return Error("back-references are not supported");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return Error(std::string("the escape \\") + c + " is not supported");
    --pos_;
    return Literal();
  }

  Result<Ranges> Literal() {
    uint32_t cp = 0;
    if (!DecodeUtf8(p_, &pos_, &cp)) return Error("invalid UTF-8");
    return Ranges{{cp, cp}};
  }

  // One member of a class: a character or an escape (maybe a whole set).
  Result<Ranges> ClassMember(bool* single) {
    *single = true;
    if (p_[pos_] == '\\') {
      ++pos_;
      if (!AtEnd() && std::strchr("dDwWsS", p_[pos_]) != nullptr) *single = false;
      return Escape();
    }
    if (p_.substr(pos_, 2) == "[:") return Error("POSIX classes ([:alpha:]) are not supported");
    return Literal();
  }

  Result<Node> Class() {
    ++pos_;  // '['
    bool negate = false;
    if (!AtEnd() && p_[pos_] == '^') negate = true, ++pos_;
    Ranges set;
    bool first = true;
    while (true) {
      if (AtEnd()) return Error("unterminated class '['");
      if (p_[pos_] == ']' && !first) break;
      first = false;
      bool single = false;
      FW_ASSIGN_OR_RETURN(Ranges lo, ClassMember(&single));
      if (single && pos_ + 1 < p_.size() && p_[pos_] == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        bool single_hi = false;
        FW_ASSIGN_OR_RETURN(Ranges hi, ClassMember(&single_hi));
        if (!single_hi || hi[0].first < lo[0].first) return Error("a bad class range");
        set.push_back({lo[0].first, hi[0].first});
      } else {
        set.insert(set.end(), lo.begin(), lo.end());
      }
    }
    ++pos_;  // ']'
    return SetNode(negate ? Complement(set) : set);
  }

  Result<Node> Atom(int depth) {
    const char c = p_[pos_];
    switch (c) {
      case '(': return Group(depth);
      case '[': return Class();
      case '.': ++pos_; return SetNode(Complement({{'\n', '\n'}}));
      case '\\': {
        ++pos_;
        FW_ASSIGN_OR_RETURN(Ranges r, Escape());
        return SetNode(std::move(r));
      }
      case '*': case '+': case '?': return Error("a quantifier with nothing to repeat");
      case '^': return Error("'^' is only supported at the start");
      case '$': return Error("'$' is only supported at the end");
      default: break;
    }
    FW_ASSIGN_OR_RETURN(Ranges r, Literal());
    return SetNode(std::move(r));
  }

  std::string_view p_;
  size_t pos_ = 0;
};

// The UTF-8 byte-range sequences whose union encodes code points [lo, hi] (surrogates
// left out), as the utf8-ranges construction splits them.
void Utf8Sequences(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>& out) {
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) Utf8Sequences(lo, 0xD7FF, out);
    if (hi > 0xDFFF) Utf8Sequences(0xE000, hi, out);
    return;
  }
  static const uint32_t kLast[] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t last : kLast) {
    if (lo <= last && hi > last) {
      Utf8Sequences(lo, last, out);
      Utf8Sequences(last + 1, hi, out);
      return;
    }
  }
  if (hi <= 0x7F) {
    out.push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
    return;
  }
  for (int i = 1; i < 4; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Utf8Sequences(lo, lo | m, out);
        Utf8Sequences((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Utf8Sequences(lo, (hi & ~m) - 1, out);
        Utf8Sequences(hi & ~m, hi, out);
        return;
      }
    }
  }
  auto encode = [](uint32_t v) {
    std::vector<uint8_t> b;
    if (v < 0x800) {
      b = {static_cast<uint8_t>(0xC0 | (v >> 6)), static_cast<uint8_t>(0x80 | (v & 0x3F))};
    } else if (v < 0x10000) {
      b = {static_cast<uint8_t>(0xE0 | (v >> 12)), static_cast<uint8_t>(0x80 | ((v >> 6) & 0x3F)),
           static_cast<uint8_t>(0x80 | (v & 0x3F))};
    } else {
      b = {static_cast<uint8_t>(0xF0 | (v >> 18)), static_cast<uint8_t>(0x80 | ((v >> 12) & 0x3F)),
           static_cast<uint8_t>(0x80 | ((v >> 6) & 0x3F)), static_cast<uint8_t>(0x80 | (v & 0x3F))};
    }
    return b;
  };
  const std::vector<uint8_t> a = encode(lo), z = encode(hi);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (size_t i = 0; i < a.size(); ++i) seq.push_back({a[i], z[i]});
  out.push_back(std::move(seq));
}

// A Thompson NFA over bytes.
class Nfa {
 public:
  struct Edge {
    uint8_t lo, hi;
    int32_t to;
  };
  struct Fragment {
    int32_t start, end;
  };

  Result<Fragment> Build(const Node& n) {
    switch (n.kind) {
      case Node::kEmpty: {
        FW_ASSIGN_OR_RETURN(int32_t s, New());
        return Fragment{s, s};
      }
      case Node::kSet: return Set(n.ranges);
      case Node::kConcat: {
        FW_ASSIGN_OR_RETURN(Fragment f, Build(n.children[0]));
        for (size_t i = 1; i < n.children.size(); ++i) {
          FW_ASSIGN_OR_RETURN(Fragment g, Build(n.children[i]));
          eps_[f.end].push_back(g.start);
          f.end = g.end;
        }
        return f;
      }
      case Node::kAlt: {
        FW_ASSIGN_OR_RETURN(int32_t s, New());
        FW_ASSIGN_OR_RETURN(int32_t e, New());
        for (const Node& c : n.children) {
          FW_ASSIGN_OR_RETURN(Fragment g, Build(c));
          eps_[s].push_back(g.start);
          eps_[g.end].push_back(e);
        }
        return Fragment{s, e};
      }
      case Node::kRepeat: return Repeat(n);
    }
    return Status::Internal("regex: unknown node");
  }

  const std::vector<std::vector<Edge>>& edges() const { return edges_; }
  const std::vector<std::vector<int32_t>>& eps() const { return eps_; }

 private:
  Result<int32_t> New() {
    if (static_cast<int64_t>(edges_.size()) >= kRegexMaxNfaStates)
      return Status::InvalidArgument("regex: over " + std::to_string(kRegexMaxNfaStates) +
                                     " automaton states (a repetition too large?)");
    edges_.emplace_back();
    eps_.emplace_back();
    return static_cast<int32_t>(edges_.size() - 1);
  }

  Result<Fragment> Set(const Ranges& ranges) {
    FW_ASSIGN_OR_RETURN(int32_t s, New());
    FW_ASSIGN_OR_RETURN(int32_t e, New());
    std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
    for (const auto& [lo, hi] : ranges) Utf8Sequences(lo, hi, seqs);
    for (const auto& seq : seqs) {
      int32_t at = s;
      for (size_t i = 0; i < seq.size(); ++i) {
        int32_t to = e;
        if (i + 1 < seq.size()) {
          FW_ASSIGN_OR_RETURN(to, New());
        }
        edges_[at].push_back({seq[i].first, seq[i].second, to});
        at = to;
      }
    }
    return Fragment{s, e};
  }

  Result<Fragment> Repeat(const Node& n) {
    FW_ASSIGN_OR_RETURN(int32_t s, New());
    Fragment f{s, s};
    for (int64_t i = 0; i < n.min; ++i) {
      FW_ASSIGN_OR_RETURN(Fragment g, Build(n.children[0]));
      eps_[f.end].push_back(g.start);
      f.end = g.end;
    }
    if (n.max < 0) {  // a loop: x*
      FW_ASSIGN_OR_RETURN(Fragment g, Build(n.children[0]));
      FW_ASSIGN_OR_RETURN(int32_t e, New());
      eps_[f.end].push_back(g.start);
      eps_[f.end].push_back(e);
      eps_[g.end].push_back(f.end);
      f.end = e;
      return f;
    }
    // Optional copies, each reachable only after the one before, each able to stop at one
    // shared exit: a set of states in the DFA holds one copy's states, not every copy's
    // (x{0,1000} builds in linear time).
    FW_ASSIGN_OR_RETURN(int32_t exit, New());
    eps_[f.end].push_back(exit);
    for (int64_t i = n.min; i < n.max; ++i) {
      FW_ASSIGN_OR_RETURN(Fragment g, Build(n.children[0]));
      eps_[f.end].push_back(g.start);
      eps_[g.end].push_back(exit);
      f.end = g.end;
    }
    f.end = exit;
    return f;
  }

  std::vector<std::vector<Edge>> edges_;
  std::vector<std::vector<int32_t>> eps_;
};

// A DFA over bytes, with the byte classes the NFA distinguishes.
class RegexGrammar final : public ByteGrammar {
 public:
  RegexGrammar(std::string pattern) : pattern_(std::move(pattern)) {}

  Status Compile(const Nfa& nfa, Nfa::Fragment whole) {
    ByteClasses(nfa);
    std::map<std::vector<int32_t>, int32_t> ids;
    std::vector<std::vector<int32_t>> sets = {Closure(nfa, {whole.start})};
    ids[sets[0]] = 0;
    for (size_t s = 0; s < sets.size(); ++s) {
      accepting_.push_back(std::binary_search(sets[s].begin(), sets[s].end(), whole.end));
      if (work_ > kRegexMaxWork)
        return Status::InvalidArgument("regex: too complex: building its automaton took over " +
                                       std::to_string(kRegexMaxWork) + " steps: '" + pattern_.substr(0, 200) + "'");
      for (int c = 0; c < classes_; ++c) {
        std::vector<int32_t> next = Move(nfa, sets[s], representative_[c]);
        int32_t id = -1;
        if (!next.empty()) {
          auto [it, fresh] = ids.try_emplace(next, static_cast<int32_t>(sets.size()));
          if (fresh) {
            const int64_t states = static_cast<int64_t>(sets.size()) + 1;
            if (states > kRegexMaxDfaStates || states * classes_ > kRegexMaxDfaEntries)
              return Status::InvalidArgument("regex: its automaton needs over " +
                                             std::to_string(std::min(kRegexMaxDfaStates, kRegexMaxDfaEntries / classes_)) +
                                             " states: '" + pattern_.substr(0, 200) + "'");
            sets.push_back(std::move(next));
          }
          id = it->second;
        }
        table_.push_back(id);
      }
    }
    return Prune();
  }

  std::string Start() override { return Encode(0); }
  bool Step(std::string& state, uint8_t byte) override {
    int32_t s;
    std::memcpy(&s, state.data(), 4);
    const int32_t next = table_[static_cast<size_t>(s) * classes_ + class_of_[byte]];
    if (next < 0) return false;
    std::memcpy(state.data(), &next, 4);
    return true;
  }
  bool Accepting(const std::string& state) override {
    int32_t s;
    std::memcpy(&s, state.data(), 4);
    return accepting_[s];
  }
  std::string Describe() const override { return "regex '" + pattern_.substr(0, 200) + "'"; }

 private:
  static std::string Encode(int32_t s) { return std::string(reinterpret_cast<const char*>(&s), 4); }

  void ByteClasses(const Nfa& nfa) {
    std::vector<bool> boundary(257, false);
    boundary[0] = true;
    for (const auto& edges : nfa.edges()) {
      for (const Nfa::Edge& e : edges) boundary[e.lo] = boundary[e.hi + 1] = true;
    }
    for (int b = 0; b < 256; ++b) {
      if (boundary[b]) {
        representative_.push_back(static_cast<uint8_t>(b));
        ++classes_;
      }
      class_of_[b] = static_cast<uint8_t>(classes_ - 1);
    }
  }

  // The states reachable from `states` by empty moves, sorted. Costs the states it visits
  // (marks are stamped, not cleared, so a call never pays for the whole NFA).
  std::vector<int32_t> Closure(const Nfa& nfa, std::vector<int32_t> states) {
    if (mark_.size() != nfa.eps().size()) mark_.assign(nfa.eps().size(), 0);
    ++stamp_;
    std::vector<int32_t> stack = states, out;
    for (int32_t s : states) mark_[s] = stamp_;
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      out.push_back(s);
      for (int32_t t : nfa.eps()[s]) {
        if (mark_[t] != stamp_) mark_[t] = stamp_, stack.push_back(t);
      }
    }
    work_ += static_cast<int64_t>(out.size());
    std::sort(out.begin(), out.end());
    return out;
  }

  std::vector<int32_t> Move(const Nfa& nfa, const std::vector<int32_t>& set, uint8_t byte) {
    std::vector<int32_t> next;
    for (int32_t s : set) {
      for (const Nfa::Edge& e : nfa.edges()[s]) {
        if (byte >= e.lo && byte <= e.hi) next.push_back(e.to);
      }
    }
    work_ += static_cast<int64_t>(set.size());
    if (next.empty()) return next;
    std::sort(next.begin(), next.end());
    next.erase(std::unique(next.begin(), next.end()), next.end());
    return Closure(nfa, next);
  }

  // Transitions into states that cannot reach an accepting one become dead ends, so a walk
  // never enters a state it cannot finish from.
  Status Prune() {
    const size_t n = accepting_.size();
    std::vector<std::vector<int32_t>> into(n);
    for (size_t s = 0; s < n; ++s) {
      for (int c = 0; c < classes_; ++c) {
        if (const int32_t t = table_[s * classes_ + c]; t >= 0) into[t].push_back(static_cast<int32_t>(s));
      }
    }
    std::vector<bool> live(n, false);
    std::vector<int32_t> stack;
    for (size_t s = 0; s < n; ++s) {
      if (accepting_[s]) live[s] = true, stack.push_back(static_cast<int32_t>(s));
    }
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      for (int32_t f : into[s]) {
        if (!live[f]) live[f] = true, stack.push_back(f);
      }
    }
    if (!live[0]) return Status::InvalidArgument("regex: '" + pattern_.substr(0, 200) + "' matches nothing");
    for (int32_t& t : table_) {
      if (t >= 0 && !live[t]) t = -1;
    }
    return Status::Ok();
  }

  std::string pattern_;
  int classes_ = 0;
  uint8_t class_of_[256] = {};
  std::vector<uint8_t> representative_;
  std::vector<int32_t> table_;  // state * classes_ + class -> state, -1: dead
  std::vector<bool> accepting_;
  std::vector<uint32_t> mark_;  // Closure's visited stamps, one per NFA state
  uint32_t stamp_ = 0;
  int64_t work_ = 0;  // NFA states visited while building
};

// --- any JSON object: a pushdown machine ---------------------------------------------

// State layout: [mode, flag, count, lo, hi, whitespace] then the stack ('o' object,
// 'a' array), innermost last.
enum JsonMode : uint8_t {
  kValue,    // a value expected; flag 1: also ']' (an array's first), 2: the top level
  kKey,      // an object key expected; flag 1: also '}' (the object's first)
  kColon,
  kAfter,    // a value ended
  kString,   // flag 1: a key; count: UTF-8 continuation bytes or \u hex digits left;
             // lo/hi: the next continuation byte's range (lo 0: in a \u escape)
  kEscape,   // after a backslash; flag as kString
  kNumber,   // count: the part (see StepNumber); lo: bytes so far
  kLiteral,  // flag: 0 true, 1 false, 2 null; count: bytes matched
};
constexpr size_t kHeader = 6;
const char* const kLiterals[] = {"true", "false", "null"};

class JsonGrammar final : public ByteGrammar {
 public:
  std::string Start() override { return std::string{static_cast<char>(kValue), 2, 0, 0, 0, 0}; }

  bool Step(std::string& s, uint8_t b) override {
    switch (static_cast<JsonMode>(s[0])) {
      case kString: return StepString(s, b);
      case kEscape: return StepEscape(s, b);
      case kNumber: return StepNumber(s, b);
      case kLiteral: {
        const char* lit = kLiterals[static_cast<int>(s[1])];
        const int at = s[2];
        if (static_cast<char>(b) != lit[at]) return false;
        if (lit[at + 1] == '\0') return Set(s, kAfter, 0), true;
        s[2] = static_cast<char>(at + 1);
        return true;
      }
      default: break;
    }
    if (b == ' ' || b == '\n' || b == '\t' || b == '\r') {
      if (s[0] == kAfter && s.size() == kHeader) return false;  // nothing after the object
      if (static_cast<uint8_t>(s[5]) >= kJsonGrammarMaxWhitespace) return false;
      s[5] = static_cast<char>(s[5] + 1);
      return true;
    }
    s[5] = 0;
    return Structural(s, b);
  }

  bool Accepting(const std::string& s) override { return s[0] == kAfter && s.size() == kHeader; }
  std::string Describe() const override { return "a JSON object"; }

 private:
  static void Set(std::string& s, JsonMode mode, char flag) {
    s[0] = static_cast<char>(mode);
    s[1] = flag;
    s[2] = s[3] = s[4] = s[5] = 0;
  }

  static bool Push(std::string& s, char kind) {
    if (s.size() - kHeader >= static_cast<size_t>(kJsonGrammarMaxDepth)) return false;
    s.push_back(kind);
    return true;
  }

  bool Structural(std::string& s, uint8_t b) {
    const char top = s.size() > kHeader ? s.back() : 0;
    switch (static_cast<JsonMode>(s[0])) {
      case kValue:
        if (s[1] == 2) return b == '{' && Push(s, 'o') && (Set(s, kKey, 1), true);
        if (s[1] == 1 && b == ']') return s.pop_back(), Set(s, kAfter, 0), true;
        return BeginValue(s, b);
      case kKey:
        if (b == '"') return Set(s, kString, 1), true;
        if (s[1] == 1 && b == '}') return s.pop_back(), Set(s, kAfter, 0), true;
        return false;
      case kColon:
        return b == ':' && (Set(s, kValue, 0), true);
      case kAfter:
        if (top == 0) return false;
        if (b == ',') return Set(s, top == 'o' ? kKey : kValue, 0), true;
        if ((top == 'o' && b == '}') || (top == 'a' && b == ']')) return s.pop_back(), Set(s, kAfter, 0), true;
        return false;
      default: return false;
    }
  }

  bool BeginValue(std::string& s, uint8_t b) {
    if (b == '{') return Push(s, 'o') && (Set(s, kKey, 1), true);
    if (b == '[') return Push(s, 'a') && (Set(s, kValue, 1), true);
    if (b == '"') return Set(s, kString, 0), true;
    if (b == '-' || (b >= '0' && b <= '9')) {
      Set(s, kNumber, 0);
      s[2] = b == '-' ? 0 : b == '0' ? 1 : 2;
      s[3] = 1;
      return true;
    }
    for (char l = 0; l < 3; ++l) {
      if (b == static_cast<uint8_t>(kLiterals[static_cast<int>(l)][0])) {
        Set(s, kLiteral, l);
        s[2] = 1;
        return true;
      }
    }
    return false;
  }

  static bool StepString(std::string& s, uint8_t b) {
    const char key = s[1];
    if (s[2] > 0) {  // a UTF-8 continuation or a \u hex digit
      if (s[3] == 0) {
        if (!std::isxdigit(b)) return false;
      } else if (b < static_cast<uint8_t>(s[3]) || b > static_cast<uint8_t>(s[4])) {
        return false;
      } else {
        s[3] = static_cast<char>(0x80), s[4] = static_cast<char>(0xBF);
      }
      s[2] = static_cast<char>(s[2] - 1);
      return true;
    }
    if (b == '"') return Set(s, key ? kColon : kAfter, 0), true;
    if (b == '\\') return Set(s, kEscape, key), true;
    if (b < 0x20) return false;
    if (b < 0x80) return true;
    // A UTF-8 lead byte: how many continuation bytes, and the first one's range.
    int n = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) n = 1;
    else if (b >= 0xE0 && b <= 0xEF) n = 2, lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
    else if (b >= 0xF0 && b <= 0xF4) n = 3, lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
    else return false;
    s[2] = static_cast<char>(n), s[3] = static_cast<char>(lo), s[4] = static_cast<char>(hi);
    return true;
  }

  static bool StepEscape(std::string& s, uint8_t b) {
    const char key = s[1];
    if (b == 'u') {
      Set(s, kString, key);
      s[2] = 4;  // four hex digits; lo 0 marks them
      return true;
    }
    if (std::strchr("\"\\/bfnrt", b) == nullptr || b == 0) return false;
    Set(s, kString, key);
    return true;
  }

  // count: 0 after '-', 1 after a leading 0, 2 in the integer digits, 3 after '.', 4 in the
  // fraction, 5 after 'e', 6 after its sign, 7 in the exponent. A byte that cannot continue
  // a whole number ends it and is read as what follows the value.
  bool StepNumber(std::string& s, uint8_t b) {
    const int part = s[2];
    const bool digit = b >= '0' && b <= '9';
    int next = -1;
    if (part == 0) next = b == '0' ? 1 : digit ? 2 : -1;
    else if ((part == 1 || part == 2) && b == '.') next = 3;
    else if ((part == 1 || part == 2 || part == 4) && (b == 'e' || b == 'E')) next = 5;
    else if (part == 2 && digit) next = 2;
    else if ((part == 3 || part == 4) && digit) next = 4;
    else if (part == 5 && (b == '+' || b == '-')) next = 6;
    else if ((part == 5 || part == 6 || part == 7) && digit) next = 7;
    if (next >= 0) {
      if (static_cast<uint8_t>(s[3]) >= 40) return false;  // a number of 40 bytes is enough
      s[2] = static_cast<char>(next);
      s[3] = static_cast<char>(s[3] + 1);
      return true;
    }
    if (part != 1 && part != 2 && part != 4 && part != 7) return false;
    Set(s, kAfter, 0);
    return Step(s, b);
  }
};

}  // namespace

Result<std::unique_ptr<ByteGrammar>> CompileRegex(std::string_view pattern, size_t max_bytes) {
  if (pattern.size() > max_bytes)
    return Status::InvalidArgument("regex: " + std::to_string(pattern.size()) + " bytes, over the limit of " +
                                   std::to_string(max_bytes));
  FW_ASSIGN_OR_RETURN(Node ast, RegexParser(pattern).Parse());
  Nfa nfa;
  FW_ASSIGN_OR_RETURN(Nfa::Fragment whole, nfa.Build(ast));
  auto grammar = std::make_unique<RegexGrammar>(std::string(pattern));
  FW_RETURN_IF_ERROR(grammar->Compile(nfa, whole));
  return std::unique_ptr<ByteGrammar>(std::move(grammar));
}

std::unique_ptr<ByteGrammar> JsonObjectGrammar() { return std::make_unique<JsonGrammar>(); }

std::string EscapeRegex(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::strchr("\\^$.|?*+()[]{}-/", c) != nullptr && c != '\0') out += '\\';
    out += c;
  }
  return out;
}

std::string ChoiceRegex(const std::vector<std::string>& choices) {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i) out += (i ? "|" : "") + EscapeRegex(choices[i]);
  return out;
}

bool GrammarAccepts(ByteGrammar& grammar, std::string_view text) {
  std::string state = grammar.Start();
  for (char c : text) {
    if (!grammar.Step(state, static_cast<uint8_t>(c))) return false;
  }
  return grammar.Accepting(state);
}

}  // namespace flywheel::tokenizer
